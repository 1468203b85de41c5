// Reductions over the middle extent of an (outer, r, inner) view; mirrors shaders/wgsl/reduce.wgsl.
// OP_SUM sums, OP_MAX takes the max (NaN propagating like numpy's for float data); MEAN scales the sum by
// p.scale. A (input), O (output), C (accumulator).

//!interface

__device__ __forceinline__ C combine(C x, C y) { return OP == OP_MAX ? bg_max_nan(x, y) : x + y; }
__device__ __forceinline__ C start(const A* a, unsigned first) { return OP == OP_MAX ? CVT(C, a[first]) : (C)0; }
__device__ __forceinline__ O finish(C x, const Params& p) {
    return MEAN ? CVT(O, (float)x * p.scale) : CVT(O, x);
}

extern "C" __global__ void reduce_rows(BG_ARGS) {
    __shared__ C partial[WG];
    unsigned lid = threadIdx.x;
    unsigned item = bg_block_index();
    bool valid = item < p.outer * p.chunks;
    unsigned clamped = bg_min(item, p.outer * p.chunks - 1u);
    unsigned piece = clamped % p.chunks;
    unsigned base = (clamped / p.chunks) * p.r + piece * p.chunk;
    unsigned count = bg_min(p.chunk, p.r - piece * p.chunk);
    C acc = start(a, base);
    for (unsigned k = lid; k < count; k += WG) acc = combine(acc, CVT(C, a[base + k]));
    partial[lid] = acc;
    __syncthreads();
    for (unsigned stride = WG / 2; stride > 0; stride >>= 1) {
        if (lid < stride) partial[lid] = combine(partial[lid], partial[lid + stride]);
        __syncthreads();
    }
    if (lid == 0 && valid) out[item] = finish(partial[0], p);
}

extern "C" __global__ void reduce_cols(BG_ARGS) {
    unsigned i = bg_thread_index();
    if (i >= p.outer * p.inner) return;
    unsigned base = (i / p.inner) * p.r * p.inner + i % p.inner;
    C acc = start(a, base);
    for (unsigned k = 0; k < p.r; k++) acc = combine(acc, CVT(C, a[base + k * p.inner]));
    out[i] = finish(acc, p);
}
