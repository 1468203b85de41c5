// Matmul with GGUF block-quantized weights: out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]).
// W is (N, K) rows of 32-weight blocks (see batchgpu/quant.py for the word layout). Each invocation
// computes ROWS (8) consecutive output features for XROWS (4) rows m0.. of x (workgroup y): it walks the
// blocks once, loads each block of the rows of x once and applies it to the 8 weight rows, dequantizing
// each weight block once in registers for all the rows of x (a batch decode's rows cost ceil(m / 4)
// dequantizations, not m). Each output's sum runs over the blocks in the same order whatever the rows
// grouped with it. Loading x once per 8 rows matters most on CPU drivers (llvmpipe), where every loaded
// scalar costs the same whatever its address; the code uses no arrays, which such drivers spill to
// memory (a vec4 lane per row of x instead). Split-K (batchgpu/ops/matmul.py): split s of p.splits takes blocks [s * block_chunk, min(blocks,
// (s + 1) * block_chunk)) and writes its partial sums to slice s of a (splits, m, n) output that a sum pass
// reduces; only split 0 adds the bias. One split covers all blocks. SWIGLU (one split, no bias): rows come in
// (gate, up) pairs and the output is (m, n / 2) of silu(gate) * up. Aliases: A (x type), O (output), C (f32),
// H (f32; f16 in the half form, HALF: see half_dot).

//!interface

//!include nan

//!include gelu

//!include qblock

// The block format of matmul_blocks / matmul_blocks_warp (batchgpu/quant.py), rendered in from
// shaders/wgsl/formats/: its load_block reads W through qword.
${FORMAT}

fn qword(i: u32) -> u32 {
    return w[i];
}

// matmul(..., activation=op): the op's expression from the op-expression table (x without one), applied
// in the store after the bias; the lowering sets it on launches of one split only.
fn activation(x: C) -> C {
    return ${ACTIVATION};
}

// One block (32 values) of a row of x, the sum of its first 16 values and its sum.
struct XBlock {
    v0: vec4<f32>, v1: vec4<f32>, v2: vec4<f32>, v3: vec4<f32>,
    v4: vec4<f32>, v5: vec4<f32>, v6: vec4<f32>, v7: vec4<f32>,
    half: f32, total: f32,
}

fn load_x(m: u32, b: u32) -> XBlock {
    let at = m * (p.k / 4u) + b * 8u;
    var xb = XBlock(x[at], x[at + 1u], x[at + 2u], x[at + 3u], x[at + 4u], x[at + 5u], x[at + 6u], x[at + 7u], 0.0, 0.0);
    let first = xb.v0 + xb.v1 + xb.v2 + xb.v3;
    let second = xb.v4 + xb.v5 + xb.v6 + xb.v7;
    xb.half = first.x + first.y + first.z + first.w;
    xb.total = xb.half + second.x + second.y + second.z + second.w;
    return xb;
}

fn low(word: u32) -> vec4<f32> {
    return vec4<f32>(unpack4xU8(word & 0x0F0F0F0Fu));
}

fn high(word: u32) -> vec4<f32> {
    return vec4<f32>(unpack4xU8((word >> 4u) & 0x0F0F0F0Fu));
}

fn signed(word: u32) -> vec4<f32> {
    return vec4<f32>(unpack4xI8(word));
}

// Q4_1 block b of row n dequantized: q0..q3 the low nibbles (x[0..16)), q4..q7 the high ones, d0 and m0.
fn q4_1_weights(n: u32, b: u32) -> QBlock {
    let at = (n * p.blocks + b) * 5u;
    let w1 = w[at + 1u];
    let w2 = w[at + 2u];
    let w3 = w[at + 3u];
    let w4 = w[at + 4u];
    let scale = unpack2x16float(w[at]);
    return QBlock(low(w1), low(w2), low(w3), low(w4), high(w1), high(w2), high(w3), high(w4), scale.x, scale.y, 0.0, 0.0);
}

// Q8_0 block b of row n dequantized: q0..q7 and d0.
fn q8_0_weights(n: u32, b: u32) -> QBlock {
    let at = (n * p.blocks + b) * 9u;
    return QBlock(signed(w[at + 1u]), signed(w[at + 2u]), signed(w[at + 3u]), signed(w[at + 4u]),
                  signed(w[at + 5u]), signed(w[at + 6u]), signed(w[at + 7u]), signed(w[at + 8u]),
                  unpack2x16float(w[at]).x, 0.0, 0.0, 0.0);
}

const Q4_1: u32 = 0u;
const Q8_0: u32 = 1u;
const FORMAT: u32 = 2u;  // the rendered FORMAT

// Block b of row n (clamped to the last row: the caller drops rows past the end) in `kind`'s layout.
fn weights_of(kind: u32, n: u32, b: u32) -> QBlock {
    let row = min(n, p.n - 1u);
    if kind == Q4_1 { return q4_1_weights(row, b); }
    if kind == Q8_0 { return q8_0_weights(row, b); }
    return load_block(p.blocks, row, b);
}

// The half form (HALF, a launch's Launch.for_half: alias H = f16): four weights of a block dequantized to f16
// (d q + m) and dotted with four values of x in f16; a block's eight such dots and the sums over blocks stay
// f32. The weights are scaled before the products (the f32 form factors d out of the block's sum), so neither
// an f16 product nor a four-term sum overflows on activations of large magnitude.
fn half_dot(q: vec4<f32>, d: f32, m: f32, x: vec4<f32>) -> f32 {
    return f32(dot(vec4<H>(q) * H(d) + H(m), vec4<H>(x)));
}

// block_dot in the half form: the first 16 weights take (d0, m0), the last 16 (d1, m1) for the rendered FORMAT
// and (d0, m0) for Q4_1 and Q8_0 (whose m0 is 0).
fn half_block_dot(kind: u32, qb: QBlock, xb: XBlock) -> f32 {
    var d1 = qb.d1;
    var m1 = qb.m1;
    if kind != FORMAT {
        d1 = qb.d0;
        m1 = qb.m0;
    }
    let first = half_dot(qb.q0, qb.d0, qb.m0, xb.v0) + half_dot(qb.q1, qb.d0, qb.m0, xb.v1)
              + half_dot(qb.q2, qb.d0, qb.m0, xb.v2) + half_dot(qb.q3, qb.d0, qb.m0, xb.v3);
    let second = half_dot(qb.q4, d1, m1, xb.v4) + half_dot(qb.q5, d1, m1, xb.v5)
               + half_dot(qb.q6, d1, m1, xb.v6) + half_dot(qb.q7, d1, m1, xb.v7);
    return first + second;
}

// A dequantized block of `kind` dotted with xb. Q4_1: d * sum(q x) + m * sum(x); Q8_0: d * sum(q x); the
// rendered FORMAT: d0 * sum(q x) + m0 * sum(x) over each half.
fn block_dot(kind: u32, qb: QBlock, xb: XBlock) -> f32 {
    if HALF { return half_block_dot(kind, qb, xb); }
    if kind == FORMAT {
        let first = dot(qb.q0, xb.v0) + dot(qb.q1, xb.v1) + dot(qb.q2, xb.v2) + dot(qb.q3, xb.v3);
        let second = dot(qb.q4, xb.v4) + dot(qb.q5, xb.v5) + dot(qb.q6, xb.v6) + dot(qb.q7, xb.v7);
        return qb.d0 * first + qb.m0 * xb.half + qb.d1 * second + qb.m1 * (xb.total - xb.half);
    }
    let qx = dot(qb.q0, xb.v0) + dot(qb.q1, xb.v1) + dot(qb.q2, xb.v2) + dot(qb.q3, xb.v3)
           + dot(qb.q4, xb.v4) + dot(qb.q5, xb.v5) + dot(qb.q6, xb.v6) + dot(qb.q7, xb.v7);
    if kind == Q4_1 { return qb.d0 * qx + qb.m0 * xb.total; }
    return qb.d0 * qx;
}

// Block b of row n dequantized once and dotted with the blocks of XROWS (4) rows of x: a vec4 lane per row.
// Lanes past `rows` (the rows of x left in the last group; uniform) stay 0.
fn block_rows(kind: u32, n: u32, b: u32, rows: u32, x0: XBlock, x1: XBlock, x2: XBlock, x3: XBlock) -> vec4<f32> {
    let qb = weights_of(kind, n, b);
    var dots = vec4<f32>(block_dot(kind, qb, x0), 0.0, 0.0, 0.0);
    if rows > 1u { dots.y = block_dot(kind, qb, x1); }
    if rows > 2u { dots.z = block_dot(kind, qb, x2); }
    if rows > 3u { dots.w = block_dot(kind, qb, x3); }
    return dots;
}

// [first, end) of the blocks split `split` takes (empty for a split past the end).
fn split_blocks(split: u32) -> vec2<u32> {
    let first = split * p.block_chunk;
    return vec2<u32>(first, min(p.blocks, first + p.block_chunk));
}

// Output (m, n) of split `split`: element (split, m, n) of the (splits, m, n) output.
fn store(split: u32, n: u32, m: u32, value: f32) {
    if n >= p.n { return; }
    var extra = 0.0;
    if HAS_BIAS && split == 0u { extra = f32(bias[n]); }
    out[(split * p.m + m) * p.n + n] = O(activation(value + extra));
}

// The SWIGLU epilogue (one split only): output (m, n / 2) of the pair of rows n (gate), n + 1 (up).
fn store_pair(n: u32, m: u32, gate: f32, up: f32) {
    if n >= p.n { return; }
    out[m * (p.n / 2u) + n / 2u] = O(gate / (1.0 + exp(-gate)) * up);
}

// Row m's outputs n0..n0 + 7; nothing for a row past the end (the last group of XROWS rows).
fn store_rows(split: u32, n0: u32, m: u32, a0: f32, a1: f32, a2: f32, a3: f32, a4: f32, a5: f32, a6: f32, a7: f32) {
    if m >= p.m { return; }
    if SWIGLU {
        store_pair(n0, m, a0, a1);
        store_pair(n0 + 2u, m, a2, a3);
        store_pair(n0 + 4u, m, a4, a5);
        store_pair(n0 + 6u, m, a6, a7);
        return;
    }
    store(split, n0, m, a0);
    store(split, n0 + 1u, m, a1);
    store(split, n0 + 2u, m, a2);
    store(split, n0 + 3u, m, a3);
    store(split, n0 + 4u, m, a4);
    store(split, n0 + 5u, m, a5);
    store(split, n0 + 6u, m, a6);
    store(split, n0 + 7u, m, a7);
}

// The sums of ROWS (8) output features, a vec4 lane per row of x.
struct RowSums {
    a0: vec4<f32>, a1: vec4<f32>, a2: vec4<f32>, a3: vec4<f32>,
    a4: vec4<f32>, a5: vec4<f32>, a6: vec4<f32>, a7: vec4<f32>,
}

// Output features n0.. of `rows` (1..XROWS) rows m0.. of x over the blocks [range.x, range.y) of `kind`:
// each weight block is dequantized once for the rows; lanes past `rows` are neither read nor computed.
// One loop iteration per block, as with one row.
fn row_group_sums(kind: u32, n0: u32, m0: u32, rows: u32, range: vec2<u32>) -> RowSums {
    var s = RowSums(vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0),
                    vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0));
    for (var b = range.x; b < range.y; b++) {
        let x0 = load_x(m0, b);
        var x1 = x0;
        var x2 = x0;
        var x3 = x0;
        if rows > 1u { x1 = load_x(m0 + 1u, b); }
        if rows > 2u { x2 = load_x(m0 + 2u, b); }
        if rows > 3u { x3 = load_x(m0 + 3u, b); }
        s.a0 += block_rows(kind, n0, b, rows, x0, x1, x2, x3);
        s.a1 += block_rows(kind, n0 + 1u, b, rows, x0, x1, x2, x3);
        s.a2 += block_rows(kind, n0 + 2u, b, rows, x0, x1, x2, x3);
        s.a3 += block_rows(kind, n0 + 3u, b, rows, x0, x1, x2, x3);
        s.a4 += block_rows(kind, n0 + 4u, b, rows, x0, x1, x2, x3);
        s.a5 += block_rows(kind, n0 + 5u, b, rows, x0, x1, x2, x3);
        s.a6 += block_rows(kind, n0 + 6u, b, rows, x0, x1, x2, x3);
        s.a7 += block_rows(kind, n0 + 7u, b, rows, x0, x1, x2, x3);
    }
    return s;
}

// ROWS consecutive output features n0.. of XROWS rows m0.. of x (workgroup y; the last group may have
// fewer) and split (workgroup z), blocks of `kind`. A single row (one sequence's decode) takes its own call
// with rows a constant 1, which the driver's compiler specializes (the lanes of other rows folded away).
fn matmul_rows(gid: vec3<u32>, wid: vec3<u32>, kind: u32) {
    let n0 = gid.x * ROWS;
    if n0 >= p.n { return; }
    let m0 = wid.y * XROWS;
    let rows = min(XROWS, p.m - m0);
    let split = wid.z;
    let range = split_blocks(split);
    var s: RowSums;
    if rows == 1u {
        s = row_group_sums(kind, n0, m0, 1u, range);
    } else {
        s = row_group_sums(kind, n0, m0, rows, range);
    }
    store_rows(split, n0, m0, s.a0.x, s.a1.x, s.a2.x, s.a3.x, s.a4.x, s.a5.x, s.a6.x, s.a7.x);
    store_rows(split, n0, m0 + 1u, s.a0.y, s.a1.y, s.a2.y, s.a3.y, s.a4.y, s.a5.y, s.a6.y, s.a7.y);
    store_rows(split, n0, m0 + 2u, s.a0.z, s.a1.z, s.a2.z, s.a3.z, s.a4.z, s.a5.z, s.a6.z, s.a7.z);
    store_rows(split, n0, m0 + 3u, s.a0.w, s.a1.w, s.a2.w, s.a3.w, s.a4.w, s.a5.w, s.a6.w, s.a7.w);
}

@compute @workgroup_size(WG)
fn matmul_q4_1(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    matmul_rows(gid, wid, Q4_1);
}

@compute @workgroup_size(WG)
fn matmul_q8_0(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    matmul_rows(gid, wid, Q8_0);
}

@compute @workgroup_size(WG)
fn matmul_blocks(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    matmul_rows(gid, wid, FORMAT);
}

// GPU-shaped twins (matmul_q4_1_warp, matmul_q8_0_warp; batchgpu/ops/matmul.py attaches them as the
// launch's GPU form, run on GPU adapters and by the CUDA/HIP executors): GEMV_WG (256) invocations = WARPS
// (8) groups of WARP (32), a group per output feature n of XROWS (4) rows m0.. of x and split, each weight
// word read once for the rows. The linear workgroup index (split over x/y) runs over ceil(p.n / WARPS)
// workgroups per group of rows, group after group, split after split. A unit
// is one data word of a block with the vec4s of x it multiplies (Q4_1: 4 per block, low nibbles
// x[4i..4i+3], high x[16+4i..]; Q8_0: 8), so a group reads W's words consecutively; the group's sum goes
// through workgroup memory.
var<workgroup> lane_sums: array<f32, GEMV_WG>;

// The sum of `value` over the lanes of lid's group, for every lane of it. The first barrier lets the
// previous call's readers finish before its slots are written again.
fn group_sum(lid: u32, value: f32) -> f32 {
    workgroupBarrier();
    lane_sums[lid] = value;
    workgroupBarrier();
    for (var stride = WARP / 2u; stride > 0u; stride >>= 1u) {
        if lid % WARP < stride { lane_sums[lid] += lane_sums[lid + stride]; }
        workgroupBarrier();
    }
    return lane_sums[lid - lid % WARP];
}

// Unit u of row `row` (a Q4_1 word) dotted with the rows m0.. of x: a vec4 lane per row, lanes past
// `rows` 0. The word is unpacked once for the rows.
fn q4_1_unit(row: u32, m0: u32, rows: u32, u: u32) -> vec4<f32> {
    let b = u / 4u;
    let i = u % 4u;
    let at = (row * p.blocks + b) * 5u;
    let word = w[at + 1u + i];
    let q_lo = low(word);
    let q_hi = high(word);
    let scale = unpack2x16float(w[at]);
    let ones = vec4<f32>(1.0);
    var dots = vec4<f32>(0.0);
    for (var j = 0u; j < rows; j++) {
        let lo = x[(m0 + j) * (p.k / 4u) + b * 8u + i];
        let hi = x[(m0 + j) * (p.k / 4u) + b * 8u + 4u + i];
        if HALF {
            dots[j] = half_dot(q_lo, scale.x, scale.y, lo) + half_dot(q_hi, scale.x, scale.y, hi);
        } else {
            dots[j] = scale.x * (dot(q_lo, lo) + dot(q_hi, hi)) + scale.y * (dot(lo, ones) + dot(hi, ones));
        }
    }
    return dots;
}

fn q8_0_unit(row: u32, m0: u32, rows: u32, u: u32) -> vec4<f32> {
    let b = u / 8u;
    let at = (row * p.blocks + b) * 9u;
    let d = unpack2x16float(w[at]).x;
    let q = signed(w[at + 1u + u % 8u]);
    var dots = vec4<f32>(0.0);
    for (var j = 0u; j < rows; j++) {
        let xs = x[(m0 + j) * (p.k / 4u) + b * 8u + u % 8u];
        if HALF {
            dots[j] = half_dot(q, d, 0.0, xs);
        } else {
            dots[j] = d * dot(q, xs);
        }
    }
    return dots;
}

fn format_unit(row: u32, m0: u32, rows: u32, b: u32) -> vec4<f32> {
    let qb = load_block(p.blocks, row, b);
    var dots = vec4<f32>(0.0);
    for (var j = 0u; j < rows; j++) {
        dots[j] = block_dot(FORMAT, qb, load_x(m0 + j, b));
    }
    return dots;
}

// One output of a group for XROWS rows m0.. of x (units of Q4_1 or Q8_0 words, or whole blocks of the
// rendered FORMAT, each read once for the rows); every invocation of the workgroup calls it. Loop
// iterations per lane: at most QUANT_BLOCK_CHUNK * 8 / WARP units, each with a loop over <= XROWS rows,
// 10,240 in all for Q8_0 (bounds.LOOP_BUDGET is 16,384), plus XROWS group sums of log2(WARP) steps.
fn warp_matmul(lid: u32, wid: vec3<u32>, groups: vec3<u32>, kind: u32) {
    let per_row = (p.n + WARPS - 1u) / WARPS;
    let row_groups = (p.m + XROWS - 1u) / XROWS;
    let block = wid.x + wid.y * groups.x;
    let split = block / per_row / row_groups;
    if split >= p.splits { return; }  // spare workgroups of a count spread over x and y (uniform)
    let m0 = block / per_row % row_groups * XROWS;
    let rows = min(XROWS, p.m - m0);
    let n = (block % per_row) * WARPS + lid / WARP;
    let row = min(n, p.n - 1u);
    let units = select(select(1u, 8u, kind == Q8_0), 4u, kind == Q4_1);  // per block
    let range = split_blocks(split) * units;
    var acc = vec4<f32>(0.0);
    for (var u = range.x + lid % WARP; u < range.y; u += WARP) {
        if kind == Q8_0 {
            acc += q8_0_unit(row, m0, rows, u);
        } else if kind == Q4_1 {
            acc += q4_1_unit(row, m0, rows, u);
        } else {
            acc += format_unit(row, m0, rows, u);
        }
    }
    for (var j = 0u; j < rows; j++) {
        let total = group_sum(lid, acc[j]);
        if SWIGLU {  // warps 2j and 2j + 1 hold the gate and up rows of a pair
            let partner = lane_sums[(lid - lid % WARP) ^ WARP];
            if lid % (2u * WARP) == 0u { store_pair(n, m0 + j, total, partner); }
        } else if lid % WARP == 0u {
            store(split, n, m0 + j, total);
        }
    }
}

@compute @workgroup_size(GEMV_WG)
fn matmul_q4_1_warp(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>,
                    @builtin(num_workgroups) groups: vec3<u32>) {
    warp_matmul(lid, wid, groups, Q4_1);
}

@compute @workgroup_size(GEMV_WG)
fn matmul_q8_0_warp(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>,
                    @builtin(num_workgroups) groups: vec3<u32>) {
    warp_matmul(lid, wid, groups, Q8_0);
}

@compute @workgroup_size(GEMV_WG)
fn matmul_blocks_warp(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>,
                      @builtin(num_workgroups) groups: vec3<u32>) {
    warp_matmul(lid, wid, groups, FORMAT);
}
