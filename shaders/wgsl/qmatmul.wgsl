// Matmul with GGUF block-quantized weights: out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]).
// W is (N, K) rows of 32-weight blocks (see batchgpu/quant.py for the word layout). Each invocation
// computes ROWS = 8 consecutive output features for one row m of x (workgroup y): it walks the blocks
// once, loads each block of x once and applies it to the 8 weight rows, dequantizing their words in
// registers. Loading x once per 8 rows matters most on CPU drivers (llvmpipe), where every loaded
// scalar costs the same whatever its address; the code uses no arrays, which such drivers spill to
// memory. Aliases: A (x type), O (output), C (f32).

override WG: u32 = 64u;
override HAS_BIAS: bool = false;
const ROWS: u32 = 8u;

struct Params {
    m: u32,
    n: u32,
    k: u32,
    blocks: u32,          // blocks per row = k / 32
}

// One block (32 values) of a row of x, and its sum.
struct XBlock {
    v0: vec4<f32>, v1: vec4<f32>, v2: vec4<f32>, v3: vec4<f32>,
    v4: vec4<f32>, v5: vec4<f32>, v6: vec4<f32>, v7: vec4<f32>,
    total: f32,
}

@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read_write> out: array<O>;
@group(0) @binding(3) var<uniform> p: Params;
@group(0) @binding(4) var<storage, read> bias: array<A>;

fn load_x(m: u32, b: u32) -> XBlock {
    let at = m * (p.k / 4u) + b * 8u;
    var xb = XBlock(x[at], x[at + 1u], x[at + 2u], x[at + 3u], x[at + 4u], x[at + 5u], x[at + 6u], x[at + 7u], 0.0);
    let s = xb.v0 + xb.v1 + xb.v2 + xb.v3 + xb.v4 + xb.v5 + xb.v6 + xb.v7;
    xb.total = s.x + s.y + s.z + s.w;
    return xb;
}

fn low(word: u32) -> vec4<f32> {
    return vec4<f32>(unpack4xU8(word & 0x0F0F0F0Fu));
}

fn high(word: u32) -> vec4<f32> {
    return vec4<f32>(unpack4xU8((word >> 4u) & 0x0F0F0F0Fu));
}

// Q4_1 block b of row n dotted with xb: d * sum(q * x) + m * sum(x). Rows past the end give 0.
fn q4_1_block(n: u32, b: u32, xb: XBlock) -> f32 {
    if n >= p.n { return 0.0; }
    let at = (n * p.blocks + b) * 5u;
    let w1 = w[at + 1u];
    let w2 = w[at + 2u];
    let w3 = w[at + 3u];
    let w4 = w[at + 4u];
    let qx = dot(low(w1), xb.v0) + dot(low(w2), xb.v1) + dot(low(w3), xb.v2) + dot(low(w4), xb.v3)
           + dot(high(w1), xb.v4) + dot(high(w2), xb.v5) + dot(high(w3), xb.v6) + dot(high(w4), xb.v7);
    let scale = unpack2x16float(w[at]);
    return scale.x * qx + scale.y * xb.total;
}

fn signed(word: u32) -> vec4<f32> {
    return vec4<f32>(unpack4xI8(word));
}

// Q8_0 block b of row n dotted with xb: d * sum(q * x). Rows past the end give 0.
fn q8_0_block(n: u32, b: u32, xb: XBlock) -> f32 {
    if n >= p.n { return 0.0; }
    let at = (n * p.blocks + b) * 9u;
    let qx = dot(signed(w[at + 1u]), xb.v0) + dot(signed(w[at + 2u]), xb.v1) + dot(signed(w[at + 3u]), xb.v2)
           + dot(signed(w[at + 4u]), xb.v3) + dot(signed(w[at + 5u]), xb.v4) + dot(signed(w[at + 6u]), xb.v5)
           + dot(signed(w[at + 7u]), xb.v6) + dot(signed(w[at + 8u]), xb.v7);
    return unpack2x16float(w[at]).x * qx;
}

fn store(n: u32, m: u32, value: f32) {
    if n >= p.n { return; }
    var extra = 0.0;
    if HAS_BIAS { extra = f32(bias[n]); }
    out[m * p.n + n] = O(value + extra);
}

fn store_rows(n0: u32, m: u32, a0: f32, a1: f32, a2: f32, a3: f32, a4: f32, a5: f32, a6: f32, a7: f32) {
    store(n0, m, a0);
    store(n0 + 1u, m, a1);
    store(n0 + 2u, m, a2);
    store(n0 + 3u, m, a3);
    store(n0 + 4u, m, a4);
    store(n0 + 5u, m, a5);
    store(n0 + 6u, m, a6);
    store(n0 + 7u, m, a7);
}

@compute @workgroup_size(WG)
fn matmul_q4_1(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let n0 = gid.x * ROWS;
    if n0 >= p.n { return; }
    let m = wid.y;
    var a0 = 0.0; var a1 = 0.0; var a2 = 0.0; var a3 = 0.0;
    var a4 = 0.0; var a5 = 0.0; var a6 = 0.0; var a7 = 0.0;
    for (var b = 0u; b < p.blocks; b++) {
        let xb = load_x(m, b);
        a0 += q4_1_block(n0, b, xb);
        a1 += q4_1_block(n0 + 1u, b, xb);
        a2 += q4_1_block(n0 + 2u, b, xb);
        a3 += q4_1_block(n0 + 3u, b, xb);
        a4 += q4_1_block(n0 + 4u, b, xb);
        a5 += q4_1_block(n0 + 5u, b, xb);
        a6 += q4_1_block(n0 + 6u, b, xb);
        a7 += q4_1_block(n0 + 7u, b, xb);
    }
    store_rows(n0, m, a0, a1, a2, a3, a4, a5, a6, a7);
}

@compute @workgroup_size(WG)
fn matmul_q8_0(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let n0 = gid.x * ROWS;
    if n0 >= p.n { return; }
    let m = wid.y;
    var a0 = 0.0; var a1 = 0.0; var a2 = 0.0; var a3 = 0.0;
    var a4 = 0.0; var a5 = 0.0; var a6 = 0.0; var a7 = 0.0;
    for (var b = 0u; b < p.blocks; b++) {
        let xb = load_x(m, b);
        a0 += q8_0_block(n0, b, xb);
        a1 += q8_0_block(n0 + 1u, b, xb);
        a2 += q8_0_block(n0 + 2u, b, xb);
        a3 += q8_0_block(n0 + 3u, b, xb);
        a4 += q8_0_block(n0 + 4u, b, xb);
        a5 += q8_0_block(n0 + 5u, b, xb);
        a6 += q8_0_block(n0 + 6u, b, xb);
        a7 += q8_0_block(n0 + 7u, b, xb);
    }
    store_rows(n0, m, a0, a1, a2, a3, a4, a5, a6, a7);
}
