// Fused elementwise chains; mirrors shaders/wgsl/fused.wgsl. Defined above: I0..I5 (inputs), O (output),
// C (compute type), FUSED_FUNCTIONS (one __device__ function per op of the program) and FUSED_BODY (the
// loads and ops, naming the last value `result`), rendered by batchgpu/ops/fused.py.

//!interface

#ifndef FUSED_FUNCTIONS
#define FUSED_FUNCTIONS
#endif
#ifndef FUSED_BODY
#define FUSED_BODY C result = (C)0;
#endif

FUSED_FUNCTIONS

// Element offset of input k for output element i: i unravelled over p.shape, dotted with k's strides.
__device__ __forceinline__ unsigned input_offset(const Params& p, unsigned i, unsigned k) {
    unsigned rem = i, offset = 0;
    for (unsigned d = p.ndim; d > 0;) {
        d--;
        unsigned extent = p.shape[d];
        offset += (rem % extent) * p.strides[k * MAX_DIMS + d];
        rem /= extent;
    }
    return offset;
}

extern "C" __global__ void fused(BG_ARGS) {
    unsigned i = bg_thread_index();
    if (i >= p.n) return;
    FUSED_BODY
    out[i] = CVT(O, result);
}
