// Tiled matmul: out[z] = A[z] (M x K) @ B[z] (K x N). Each 16x16 workgroup computes a 64x64 output
// tile; k advances 16 at a time through tiles staged in workgroup memory (as vec4 rows/columns);
// each invocation keeps 4x4 accumulators in four vec4 registers. Operands are read through element strides, so transposes are free.
// Aliases: A (operand type), O (output), C (accumulator type).

override HAS_BIAS: bool = false;
const TILE: u32 = 64u;
const TK: u32 = 16u;

struct Params {
    m: u32,
    n: u32,
    k: u32,
    batch_ndim: u32,
    strides: vec4<u32>,                 // a_sm, a_sk, b_sk, b_sn
    pad: vec4<u32>,
    batch_shape: array<vec4<u32>, 2>,
    a_batch_strides: array<vec4<u32>, 2>,
    b_batch_strides: array<vec4<u32>, 2>,
}

@group(0) @binding(0) var<storage, read> a: array<A>;
@group(0) @binding(1) var<storage, read> b: array<A>;
@group(0) @binding(2) var<storage, read_write> out: array<O>;
@group(0) @binding(3) var<uniform> p: Params;
@group(0) @binding(4) var<storage, read> bias: array<A>;   // per output column, added when HAS_BIAS

var<workgroup> a_tile: array<vec4<C>, 256>;   // [TK][TILE / 4]: 4 consecutive rows at one k
var<workgroup> b_tile: array<vec4<C>, 256>;   // [TK][TILE / 4]: 4 consecutive columns at one k

fn load_a(base: u32, row: u32, k: u32) -> C {
    if row < p.m && k < p.k { return C(a[base + row * p.strides.x + k * p.strides.y]); }
    return C(0);
}

fn load_b(base: u32, k: u32, col: u32) -> C {
    if k < p.k && col < p.n { return C(b[base + k * p.strides.z + col * p.strides.w]); }
    return C(0);
}

@compute @workgroup_size(16, 16)
fn matmul(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    var rem = wid.z;
    var a_base = 0u;
    var b_base = 0u;
    var d = p.batch_ndim;
    loop {
        if d == 0u { break; }
        d -= 1u;
        let extent = p.batch_shape[d / 4u][d % 4u];
        let index = rem % extent;
        rem /= extent;
        a_base += index * p.a_batch_strides[d / 4u][d % 4u];
        b_base += index * p.b_batch_strides[d / 4u][d % 4u];
    }
    let row0 = wid.y * TILE;
    let col0 = wid.x * TILE;
    // Staging role of this invocation: one vec4 of the A tile and one of the B tile per k step.
    let stage_k = lid.y;
    let stage_row = row0 + lid.x * 4u;
    let stage_col = col0 + lid.x * 4u;

    var acc0 = vec4<C>();
    var acc1 = vec4<C>();
    var acc2 = vec4<C>();
    var acc3 = vec4<C>();
    for (var k0 = 0u; k0 < p.k; k0 += TK) {
        let k = k0 + stage_k;
        a_tile[stage_k * 16u + lid.x] = vec4<C>(load_a(a_base, stage_row, k), load_a(a_base, stage_row + 1u, k),
                                                load_a(a_base, stage_row + 2u, k), load_a(a_base, stage_row + 3u, k));
        b_tile[stage_k * 16u + lid.x] = vec4<C>(load_b(b_base, k, stage_col), load_b(b_base, k, stage_col + 1u),
                                                load_b(b_base, k, stage_col + 2u), load_b(b_base, k, stage_col + 3u));
        workgroupBarrier();
        for (var kk = 0u; kk < TK; kk++) {
            let av = a_tile[kk * 16u + lid.y];
            let bv = b_tile[kk * 16u + lid.x];
            acc0 += av.x * bv;
            acc1 += av.y * bv;
            acc2 += av.z * bv;
            acc3 += av.w * bv;
        }
        workgroupBarrier();
    }
    let out_base = wid.z * p.m * p.n;
    let row = row0 + lid.y * 4u;
    let col = col0 + lid.x * 4u;
    store_row(out_base, row, col, acc0);
    store_row(out_base, row + 1u, col, acc1);
    store_row(out_base, row + 2u, col, acc2);
    store_row(out_base, row + 3u, col, acc3);
}

fn store_row(base: u32, row: u32, col: u32, values: vec4<C>) {
    if row >= p.m { return; }
    for (var j = 0u; j < 4u; j++) {
        if col + j < p.n {
            var value = values[j];
            if HAS_BIAS { value += C(bias[col + j]); }
            out[base + row * p.n + col + j] = O(value);
        }
    }
}

// Skinny matmul for few rows of A (decode-style GEMV): each invocation computes 8 consecutive output
// columns of one row of A (workgroup y), so each loaded value of A serves 8 columns. No workgroup
// memory or private arrays: on CPU drivers (llvmpipe) every loaded scalar costs the same wherever it
// comes from and dynamically indexed arrays spill to memory, so fewer loads is what counts there.
fn b_at(k: u32, col: u32) -> C {
    if col >= p.n { return C(0); }
    return C(b[k * p.strides.z + col * p.strides.w]);
}

fn store_skinny(row: u32, col: u32, value: C) {
    if col >= p.n { return; }
    var result = value;
    if HAS_BIAS { result += C(bias[col]); }
    out[row * p.n + col] = O(result);
}

@compute @workgroup_size(64)
fn matmul_skinny(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let col = gid.x * 8u;
    if col >= p.n { return; }
    let row = wid.y;
    var lo = vec4<C>();
    var hi = vec4<C>();
    for (var k = 0u; k < p.k; k++) {
        let av = C(a[row * p.strides.x + k * p.strides.y]);
        lo += av * vec4<C>(b_at(k, col), b_at(k, col + 1u), b_at(k, col + 2u), b_at(k, col + 3u));
        hi += av * vec4<C>(b_at(k, col + 4u), b_at(k, col + 5u), b_at(k, col + 6u), b_at(k, col + 7u));
    }
    store_skinny(row, col, lo.x);
    store_skinny(row, col + 1u, lo.y);
    store_skinny(row, col + 2u, lo.z);
    store_skinny(row, col + 3u, lo.w);
    store_skinny(row, col + 4u, hi.x);
    store_skinny(row, col + 5u, hi.y);
    store_skinny(row, col + 6u, hi.z);
    store_skinny(row, col + 7u, hi.w);
}

// GPU-shaped twin of matmul_skinny for b stored (N, K) (transpose_b; batchgpu/ops/matmul.py attaches
// it as the launch's GPU form): 256 invocations = 8 groups of 32, a group per output column n (the
// linear workgroup index times 8 plus the group), lanes striding over k so a group reads a row of B
// consecutively; the p.m <= 8 rows of A share each B load; sums go through workgroup memory.
var<workgroup> gemv_sums: array<C, 2048>;   // [8 rows][256 invocations]

@compute @workgroup_size(256)
fn matmul_gemv_t(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>,
                 @builtin(num_workgroups) groups: vec3<u32>) {
    let lane = lid % 32u;
    let n = (wid.x + wid.y * groups.x) * 8u + lid / 32u;
    let col = min(n, p.n - 1u);
    var acc: array<C, 8>;
    var k = lane;
    for (; k + 96u < p.k; k += 128u) {  // four loads of B in flight per invocation
        let b0 = C(b[col * p.strides.w + k]);
        let b1 = C(b[col * p.strides.w + k + 32u]);
        let b2 = C(b[col * p.strides.w + k + 64u]);
        let b3 = C(b[col * p.strides.w + k + 96u]);
        for (var r = 0u; r < p.m; r++) {
            let at = r * p.strides.x + k * p.strides.y;
            acc[r] += C(a[at]) * b0 + C(a[at + 32u * p.strides.y]) * b1 + C(a[at + 64u * p.strides.y]) * b2
                    + C(a[at + 96u * p.strides.y]) * b3;
        }
    }
    for (; k < p.k; k += 32u) {
        let bv = C(b[col * p.strides.w + k]);
        for (var r = 0u; r < p.m; r++) { acc[r] += C(a[r * p.strides.x + k * p.strides.y]) * bv; }
    }
    for (var r = 0u; r < 8u; r++) { gemv_sums[r * 256u + lid] = acc[r]; }
    workgroupBarrier();
    for (var stride = 16u; stride > 0u; stride >>= 1u) {
        if lane < stride {
            for (var r = 0u; r < p.m; r++) { gemv_sums[r * 256u + lid] += gemv_sums[r * 256u + lid + stride]; }
        }
        workgroupBarrier();
    }
    if lane == 0u && n < p.n {
        for (var r = 0u; r < p.m; r++) {
            var value = gemv_sums[r * 256u + lid];
            if HAS_BIAS { value += C(bias[n]); }
            out[r * p.n + n] = O(value);
        }
    }
}
