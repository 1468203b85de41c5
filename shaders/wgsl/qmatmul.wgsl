// Matmul with GGUF block-quantized weights: out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]).
// W is (N, K) rows of 32-weight blocks (see batchgpu/quant.py for the word layout). One invocation
// per output feature n; it walks the row's blocks once, dequantizes each in registers and applies it
// to up to M_TILE rows of x (workgroup y picks the x rows). Aliases: A (x type), O (output), C (f32).

override WG: u32 = 64u;
override HAS_BIAS: bool = false;
const M_TILE: u32 = 8u;

struct Params {
    m: u32,
    n: u32,
    k: u32,
    blocks: u32,          // blocks per row = k / 32
}

@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read_write> out: array<O>;
@group(0) @binding(3) var<uniform> p: Params;
@group(0) @binding(4) var<storage, read> bias: array<A>;

// The dot product of 32 dequantized weights (8 vec4 of q, scale d, offset m) with x row `row` at
// block `b`: d * sum(q * x) + m * sum(x).
fn block_dot(q: array<vec4<f32>, 8>, d: f32, offset: f32, row: u32, b: u32) -> f32 {
    let base = row * (p.k / 4u) + b * 8u;
    var qx = 0.0;
    var sx = 0.0;
    for (var i = 0u; i < 8u; i++) {
        let xv = x[base + i];
        qx += dot(q[i], xv);
        sx += dot(xv, vec4<f32>(1.0));
    }
    return d * qx + offset * sx;
}

fn store(n: u32, m0: u32, count: u32, acc: array<f32, 8>) {
    var extra = 0.0;
    if HAS_BIAS { extra = f32(bias[n]); }
    for (var i = 0u; i < M_TILE; i++) {
        if i < count { out[(m0 + i) * p.n + n] = O(acc[i] + extra); }
    }
}

@compute @workgroup_size(WG)
fn matmul_q4_1(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let n = gid.x;
    if n >= p.n { return; }
    let m0 = wid.y * M_TILE;
    let count = min(M_TILE, p.m - m0);
    var acc: array<f32, 8>;
    for (var b = 0u; b < p.blocks; b++) {
        let at = (n * p.blocks + b) * 5u;
        let scale = unpack2x16float(w[at]);
        var q: array<vec4<f32>, 8>;
        for (var i = 0u; i < 4u; i++) {
            let word = w[at + 1u + i];
            q[i] = vec4<f32>(unpack4xU8(word & 0x0F0F0F0Fu));
            q[i + 4u] = vec4<f32>(unpack4xU8((word >> 4u) & 0x0F0F0F0Fu));
        }
        for (var i = 0u; i < M_TILE; i++) {
            if i < count { acc[i] += block_dot(q, scale.x, scale.y, m0 + i, b); }
        }
    }
    store(n, m0, count, acc);
}

@compute @workgroup_size(WG)
fn matmul_q8_0(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let n = gid.x;
    if n >= p.n { return; }
    let m0 = wid.y * M_TILE;
    let count = min(M_TILE, p.m - m0);
    var acc: array<f32, 8>;
    for (var b = 0u; b < p.blocks; b++) {
        let at = (n * p.blocks + b) * 9u;
        let scale = unpack2x16float(w[at]).x;
        var q: array<vec4<f32>, 8>;
        for (var i = 0u; i < 8u; i++) {
            q[i] = vec4<f32>(unpack4xI8(w[at + 1u + i]));
        }
        for (var i = 0u; i < M_TILE; i++) {
            if i < count { acc[i] += block_dot(q, scale, 0.0, m0 + i, b); }
        }
    }
    store(n, m0, count, acc);
}
