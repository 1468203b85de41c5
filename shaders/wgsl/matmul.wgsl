// Tiled matmul: out[z] = A[z] (M x K) @ B[z] (K x N). Each TILE_WG x TILE_WG (16x16) workgroup computes a
// TILE x TILE (64x64) output tile; k advances TK (16) at a time through tiles staged in workgroup memory
// (as vec4 rows/columns); each invocation keeps 4x4 accumulators in four vec4 registers. Operands are read
// through element strides, so transposes are free.
// Split-K (batchgpu/ops/matmul.py): split s of p.split_k.y accumulates k in [s * k_chunk, min(k, (s + 1) * k_chunk))
// and writes its partial products to slice s of a (batch, splits, m, n) output that a sum pass reduces; only split 0
// adds the bias. One split covers all of k. Aliases: A (operand type), O (output), C (accumulator type).

//!interface

//!include nan

//!include gelu

// matmul(..., activation=op): the op's expression from the op-expression table (x without one), applied
// in the store after the bias; the lowering sets it on launches of one split only.
fn activation(x: C) -> C {
    return ${ACTIVATION};
}

var<workgroup> a_tile: array<vec4<C>, TK * TILE_WG>;   // [TK][TILE / 4]: 4 consecutive rows at one k
var<workgroup> b_tile: array<vec4<C>, TK * TILE_WG>;   // [TK][TILE / 4]: 4 consecutive columns at one k

// [first, end) of the k values split `split` accumulates (empty for a split past the end).
fn split_range(split: u32) -> vec2<u32> {
    let first = split * p.split_k.x;
    return vec2<u32>(first, min(p.k, first + p.split_k.x));
}

fn load_a(base: u32, row: u32, k: u32) -> C {
    if row < p.m && k < p.k { return C(a[base + row * p.strides.x + k * p.strides.y]); }
    return C(0);
}

fn load_b(base: u32, k: u32, col: u32) -> C {
    if k < p.k && col < p.n { return C(b[base + k * p.strides.z + col * p.strides.w]); }
    return C(0);
}

@compute @workgroup_size(TILE_WG, TILE_WG)
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
    let splits = p.split_k.y;
    let split = wid.y % splits;         // grid y runs over m tiles x splits
    let row0 = (wid.y / splits) * TILE;
    let col0 = wid.x * TILE;
    // Staging role of this invocation: one vec4 of the A tile and one of the B tile per k step.
    let stage_k = lid.y;
    let stage_row = row0 + lid.x * 4u;
    let stage_col = col0 + lid.x * 4u;

    var acc0 = vec4<C>();
    var acc1 = vec4<C>();
    var acc2 = vec4<C>();
    var acc3 = vec4<C>();
    let range = split_range(split);   // k_chunk is a multiple of TK: no tile straddles two splits
    for (var k0 = range.x; k0 < range.y; k0 += TK) {
        let k = k0 + stage_k;
        a_tile[stage_k * TILE_WG + lid.x] = vec4<C>(load_a(a_base, stage_row, k), load_a(a_base, stage_row + 1u, k),
                                                load_a(a_base, stage_row + 2u, k), load_a(a_base, stage_row + 3u, k));
        b_tile[stage_k * TILE_WG + lid.x] = vec4<C>(load_b(b_base, k, stage_col), load_b(b_base, k, stage_col + 1u),
                                                load_b(b_base, k, stage_col + 2u), load_b(b_base, k, stage_col + 3u));
        workgroupBarrier();
        for (var kk = 0u; kk < TK; kk++) {
            let av = a_tile[kk * TILE_WG + lid.y];
            let bv = b_tile[kk * TILE_WG + lid.x];
            acc0 += av.x * bv;
            acc1 += av.y * bv;
            acc2 += av.z * bv;
            acc3 += av.w * bv;
        }
        workgroupBarrier();
    }
    let out_base = (wid.z * splits + split) * p.m * p.n;
    let row = row0 + lid.y * 4u;
    let col = col0 + lid.x * 4u;
    let with_bias = split == 0u;
    store_row(out_base, row, col, acc0, with_bias);
    store_row(out_base, row + 1u, col, acc1, with_bias);
    store_row(out_base, row + 2u, col, acc2, with_bias);
    store_row(out_base, row + 3u, col, acc3, with_bias);
}

fn store_row(base: u32, row: u32, col: u32, values: vec4<C>, with_bias: bool) {
    if row >= p.m { return; }
    for (var j = 0u; j < 4u; j++) {
        if col + j < p.n {
            var value = values[j];
            if HAS_BIAS && with_bias { value += C(bias[col + j]); }
            out[base + row * p.n + col + j] = O(activation(value));
        }
    }
}

// Skinny matmul for few rows of A (decode-style GEMV): each invocation computes SKINNY_COLUMNS (8)
// consecutive output columns of one row of A (workgroup y) and split (workgroup z), so each loaded value
// of A serves 8 columns (two vec4 accumulators). No workgroup memory or private arrays: on CPU drivers
// (llvmpipe) every loaded scalar costs the same wherever it comes from and dynamically indexed arrays spill
// to memory, so fewer loads is what counts there.
fn b_at(k: u32, col: u32) -> C {
    if col >= p.n { return C(0); }
    return C(b[k * p.strides.z + col * p.strides.w]);
}

// Output (row, col) of split `split`: element (split, row, col) of the (splits, m, n) output.
fn store_skinny(split: u32, row: u32, col: u32, value: C) {
    if col >= p.n { return; }
    var result = value;
    if HAS_BIAS && split == 0u { result += C(bias[col]); }
    out[(split * p.m + row) * p.n + col] = O(activation(result));
}

@compute @workgroup_size(SKINNY_WG)
fn matmul_skinny(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let col = gid.x * SKINNY_COLUMNS;
    if col >= p.n { return; }
    let row = wid.y;
    let split = wid.z;
    let range = split_range(split);
    var lo = vec4<C>();
    var hi = vec4<C>();
    for (var k = range.x; k < range.y; k++) {
        let av = C(a[row * p.strides.x + k * p.strides.y]);
        lo += av * vec4<C>(b_at(k, col), b_at(k, col + 1u), b_at(k, col + 2u), b_at(k, col + 3u));
        hi += av * vec4<C>(b_at(k, col + 4u), b_at(k, col + 5u), b_at(k, col + 6u), b_at(k, col + 7u));
    }
    store_skinny(split, row, col, lo.x);
    store_skinny(split, row, col + 1u, lo.y);
    store_skinny(split, row, col + 2u, lo.z);
    store_skinny(split, row, col + 3u, lo.w);
    store_skinny(split, row, col + 4u, hi.x);
    store_skinny(split, row, col + 5u, hi.y);
    store_skinny(split, row, col + 6u, hi.z);
    store_skinny(split, row, col + 7u, hi.w);
}

// GPU-shaped twin of matmul_skinny for b stored (N, K) (transpose_b; batchgpu/ops/matmul.py attaches
// it as the launch's GPU form): GEMV_WG (256) invocations = WARPS (8) groups of WARP (32), a group per
// output column n of one split (the linear workgroup index runs over ceil(p.n / WARPS) workgroups per
// split, split after split), lanes striding over the split's k so a group reads a row of B consecutively;
// the p.m <= SKINNY_ROWS rows of A share each B load; sums go through workgroup memory.
var<workgroup> gemv_sums: array<C, SKINNY_ROWS * GEMV_WG>;   // [SKINNY_ROWS rows][GEMV_WG invocations]

@compute @workgroup_size(GEMV_WG)
fn matmul_gemv_t(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>,
                 @builtin(num_workgroups) groups: vec3<u32>) {
    let lane = lid % WARP;
    let per_split = (p.n + WARPS - 1u) / WARPS;
    let block = wid.x + wid.y * groups.x;
    let split = block / per_split;
    if split >= p.split_k.y { return; }  // spare workgroups of a count spread over x and y (uniform)
    let n = (block % per_split) * WARPS + lid / WARP;
    let col = min(n, p.n - 1u);
    let range = split_range(split);
    var acc: array<C, SKINNY_ROWS>;
    var k = range.x + lane;
    for (; k + 3u * WARP < range.y; k += 4u * WARP) {  // four loads of B in flight per invocation
        let b0 = C(b[col * p.strides.w + k]);
        let b1 = C(b[col * p.strides.w + k + WARP]);
        let b2 = C(b[col * p.strides.w + k + 2u * WARP]);
        let b3 = C(b[col * p.strides.w + k + 3u * WARP]);
        for (var r = 0u; r < p.m; r++) {
            let at = r * p.strides.x + k * p.strides.y;
            acc[r] += C(a[at]) * b0 + C(a[at + WARP * p.strides.y]) * b1 + C(a[at + 2u * WARP * p.strides.y]) * b2
                    + C(a[at + 3u * WARP * p.strides.y]) * b3;
        }
    }
    for (; k < range.y; k += WARP) {
        let bv = C(b[col * p.strides.w + k]);
        for (var r = 0u; r < p.m; r++) { acc[r] += C(a[r * p.strides.x + k * p.strides.y]) * bv; }
    }
    for (var r = 0u; r < SKINNY_ROWS; r++) { gemv_sums[r * GEMV_WG + lid] = acc[r]; }
    workgroupBarrier();
    for (var stride = WARP / 2u; stride > 0u; stride >>= 1u) {
        if lane < stride {
            for (var r = 0u; r < p.m; r++) { gemv_sums[r * GEMV_WG + lid] += gemv_sums[r * GEMV_WG + lid + stride]; }
        }
        workgroupBarrier();
    }
    if lane == 0u && n < p.n {
        for (var r = 0u; r < p.m; r++) {
            var value = gemv_sums[r * GEMV_WG + lid];
            if HAS_BIAS && split == 0u { value += C(bias[n]); }
            out[(split * p.m + r) * p.n + n] = O(activation(value));
        }
    }
}
