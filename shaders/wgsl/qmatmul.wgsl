// Matmul with GGUF block-quantized weights: out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]).
// W is (N, K) rows of 32-weight blocks (see batchgpu/quant.py for the word layout). One invocation
// per output (n, m): it walks row n's blocks, dequantizes each word in registers and takes the dot
// product with x row m (workgroup y). No private arrays: on CPU drivers such as llvmpipe, dynamically
// indexed arrays spill to memory. Aliases: A (x type), O (output), C (f32).

override WG: u32 = 64u;
override HAS_BIAS: bool = false;

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

fn store(n: u32, m: u32, value: f32) {
    var extra = 0.0;
    if HAS_BIAS { extra = f32(bias[n]); }
    out[m * p.n + n] = O(value + extra);
}

@compute @workgroup_size(WG)
fn matmul_q4_1(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let n = gid.x;
    if n >= p.n { return; }
    let m = wid.y;
    let x_row = m * (p.k / 4u);
    var acc = 0.0;
    for (var b = 0u; b < p.blocks; b++) {
        let at = (n * p.blocks + b) * 5u;
        let xb = x_row + b * 8u;
        var qx = 0.0;
        var sx = vec4<f32>();
        for (var i = 0u; i < 4u; i++) {
            let word = w[at + 1u + i];
            let low = x[xb + i];
            let high = x[xb + 4u + i];
            qx += dot(vec4<f32>(unpack4xU8(word & 0x0F0F0F0Fu)), low);
            qx += dot(vec4<f32>(unpack4xU8((word >> 4u) & 0x0F0F0F0Fu)), high);
            sx += low + high;
        }
        let scale = unpack2x16float(w[at]);
        acc += scale.x * qx + scale.y * (sx.x + sx.y + sx.z + sx.w);
    }
    store(n, m, acc);
}

@compute @workgroup_size(WG)
fn matmul_q8_0(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let n = gid.x;
    if n >= p.n { return; }
    let m = wid.y;
    let x_row = m * (p.k / 4u);
    var acc = 0.0;
    for (var b = 0u; b < p.blocks; b++) {
        let at = (n * p.blocks + b) * 9u;
        let xb = x_row + b * 8u;
        var qx = 0.0;
        for (var i = 0u; i < 8u; i++) {
            qx += dot(vec4<f32>(unpack4xI8(w[at + 1u + i])), x[xb + i]);
        }
        acc += unpack2x16float(w[at]).x * qx;
    }
    store(n, m, acc);
}
