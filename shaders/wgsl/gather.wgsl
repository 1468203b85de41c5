// Row gathers. embedding: out[i, :] = table[ids[i], :] (ids outside [0, rows) give zeros);
// argmax_rows: index of the first maximum (NaN first, as numpy) of each row, or of each piece of p.chunk
// elements of a longer row (one workgroup per piece, (value, index) tree); argmax_candidates: for long
// rows, one workgroup per row picks the best of its pieces' candidates.
// Aliases: A (table / input type), O (output type), C (compute type of A).

//!interface

@compute @workgroup_size(WG)
fn embedding(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = gid.x + gid.y * groups.x * WG;
    if i >= p.count * p.width { return; }
    let id = ids[i / p.width];
    var value = O(0);
    if id >= 0 && u32(id) < p.rows { value = O(table[u32(id) * p.width + i % p.width]); }
    out[i] = value;
}

// One weight of a quantized table: row `id`, column `c`.
fn q4_1_weight(id: u32, c: u32) -> f32 {
    let at = (id * (p.width / 32u) + c / 32u) * 5u;
    let scale = unpack2x16float(qtable[at]);
    let j = c % 32u;
    let byte = (qtable[at + 1u + (j % 16u) / 4u] >> (8u * (j % 4u))) & 0xFFu;
    let q = select(byte & 0x0Fu, byte >> 4u, j >= 16u);
    return scale.x * f32(q) + scale.y;
}

fn q8_0_weight(id: u32, c: u32) -> f32 {
    let at = (id * (p.width / 32u) + c / 32u) * 9u;
    let j = c % 32u;
    let q = extractBits(i32(qtable[at + 1u + j / 4u]), 8u * (j % 4u), 8u);
    return unpack2x16float(qtable[at]).x * f32(q);
}

//!include qblock

// The block format of embedding_blocks (batchgpu/quant.py), rendered in from shaders/wgsl/formats/: its
// load_block reads the table through qword.
${FORMAT}

fn qword(i: u32) -> u32 {
    return qtable[i];
}

const Q4_1: u32 = 0u;
const Q8_0: u32 = 1u;
const FORMAT: u32 = 2u;  // the rendered FORMAT

// A quantized-table embedding: ids outside [0, rows) give zeros.
fn embed_quantized(gid: vec3<u32>, groups: vec3<u32>, kind: u32) {
    let i = gid.x + gid.y * groups.x * WG;
    if i >= p.count * p.width { return; }
    let id = ids[i / p.width];
    var value = 0.0;
    if id >= 0 && u32(id) < p.rows {
        let c = i % p.width;
        if kind == Q8_0 {
            value = q8_0_weight(u32(id), c);
        } else if kind == Q4_1 {
            value = q4_1_weight(u32(id), c);
        } else {
            value = block_value(load_block(p.width / 32u, u32(id), c / 32u), c % 32u);
        }
    }
    out[i] = O(value);
}

@compute @workgroup_size(WG)
fn embedding_q4_1(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    embed_quantized(gid, groups, Q4_1);
}

@compute @workgroup_size(WG)
fn embedding_q8_0(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    embed_quantized(gid, groups, Q8_0);
}

@compute @workgroup_size(WG)
fn embedding_blocks(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    embed_quantized(gid, groups, FORMAT);
}

// is_nan: NaN by bit pattern, for float data only (IS_FLOAT, set for argmax of float data); argmax's
// order and its (value, index) tree.
//!include nan
//!include best

fn argmax_chunks() -> u32 {
    return (p.width - 1u) / p.chunk + 1u;
}

// Workgroup `item` takes piece item % chunks of row item / chunks and writes the row index of the piece's
// best element to indices[item] (rows taken whole: chunks = 1, item = row).
@compute @workgroup_size(WG)
fn argmax_rows(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
               @builtin(num_workgroups) groups: vec3<u32>) {
    let item = wid.x + wid.y * groups.x;
    let chunks = argmax_chunks();
    let clamped = min(item, p.count * chunks - 1u);
    let first = (clamped % chunks) * p.chunk;
    let count = min(p.chunk, p.width - first);
    let base = (clamped / chunks) * p.width + first;
    var value = C(table[base]);
    var index = 0u;
    for (var k = lid.x; k < count; k += WG) {
        let v = C(table[base + k]);
        if better(v, k, value, index) { value = v; index = k; }
    }
    let best = tree_best(lid.x, value, index);
    if lid.x == 0u && item < p.count * chunks { indices[item] = i32(first + best); }
}

// Long rows, second pass: one workgroup per row reads its pieces' candidate indices (ids, as argmax_rows
// wrote them) and writes the best one to indices[row].
@compute @workgroup_size(WG)
fn argmax_candidates(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
                     @builtin(num_workgroups) groups: vec3<u32>) {
    let row = wid.x + wid.y * groups.x;
    let clamped = min(row, p.count - 1u);
    let chunks = argmax_chunks();
    let first = clamped * chunks;
    let base = clamped * p.width;
    var index = u32(ids[first]);
    var value = C(table[base + index]);
    for (var j = lid.x; j < chunks; j += WG) {
        let k = u32(ids[first + j]);
        let v = C(table[base + k]);
        if better(v, k, value, index) { value = v; index = k; }
    }
    let best = tree_best(lid.x, value, index);
    if lid.x == 0u && row < p.count { indices[row] = i32(best); }
}
