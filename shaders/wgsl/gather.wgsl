// Row gathers. embedding: out[i, :] = table[ids[i], :] (ids outside [0, rows) give zeros);
// argmax_rows: index of the first maximum of each row (one workgroup per row, (value, index) tree).
// Aliases: A (table / input type), O (output type), C (compute type of A).

override WG: u32 = 256u;

struct Params {
    count: u32,    // embedding: number of ids; argmax: rows
    width: u32,    // embedding: row width; argmax: row length
    rows: u32,     // embedding: table rows
    pad: u32,
}

@group(0) @binding(0) var<storage, read> ids: array<i32>;
@group(0) @binding(1) var<storage, read> table: array<A>;
@group(0) @binding(2) var<storage, read_write> out: array<O>;
@group(0) @binding(3) var<uniform> p: Params;
@group(0) @binding(4) var<storage, read_write> indices: array<i32>;
@group(0) @binding(5) var<storage, read> qtable: array<u32>;   // quantized table (batchgpu/quant.py layout)

var<workgroup> best_value: array<C, WG>;
var<workgroup> best_index: array<u32, WG>;

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

// A quantized-table embedding: ids outside [0, rows) give zeros.
fn embed_quantized(gid: vec3<u32>, groups: vec3<u32>, q8: bool) {
    let i = gid.x + gid.y * groups.x * WG;
    if i >= p.count * p.width { return; }
    let id = ids[i / p.width];
    var value = 0.0;
    if id >= 0 && u32(id) < p.rows {
        if q8 {
            value = q8_0_weight(u32(id), i % p.width);
        } else {
            value = q4_1_weight(u32(id), i % p.width);
        }
    }
    out[i] = O(value);
}

@compute @workgroup_size(WG)
fn embedding_q4_1(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    embed_quantized(gid, groups, false);
}

@compute @workgroup_size(WG)
fn embedding_q8_0(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    embed_quantized(gid, groups, true);
}

@compute @workgroup_size(WG)
fn argmax_rows(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
               @builtin(num_workgroups) groups: vec3<u32>) {
    let row = wid.x + wid.y * groups.x;
    let base = min(row, p.count - 1u) * p.width;
    var value = C(table[base]);
    var index = 0u;
    for (var k = lid.x; k < p.width; k += WG) {
        let v = C(table[base + k]);
        if v > value { value = v; index = k; }
    }
    best_value[lid.x] = value;
    best_index[lid.x] = index;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        if lid.x < stride {
            let v = best_value[lid.x + stride];
            let k = best_index[lid.x + stride];
            if v > best_value[lid.x] || (v == best_value[lid.x] && k < best_index[lid.x]) {
                best_value[lid.x] = v;
                best_index[lid.x] = k;
            }
        }
        workgroupBarrier();
    }
    if lid.x == 0u && row < p.count { indices[row] = i32(best_index[0]); }
}
