// Elementwise ops; mirrors shaders/wgsl/elementwise.wgsl. Defined above: A, B (inputs), O (output),
// C (compute type), UNARY_EXPR (of x), BINARY_EXPR (of x, y), A_MODE, B_MODE (CONTIGUOUS: read at the
// output index, SCALAR: broadcast scalar, STRIDED: read through broadcast strides).

//!interface

#ifndef UNARY_EXPR
#define UNARY_EXPR x
#endif
#ifndef BINARY_EXPR
#define BINARY_EXPR x
#endif

__device__ __forceinline__ C unary_op(C x) { return UNARY_EXPR; }
__device__ __forceinline__ C binary_op(C x, C y) { return BINARY_EXPR; }

extern "C" __global__ void unary(BG_ARGS) {
    unsigned i = bg_thread_index();
    if (i >= p.n) return;
    out[i] = CVT(O, unary_op(CVT(C, a[i])));
}

extern "C" __global__ void binary(BG_ARGS) {
    unsigned i = bg_thread_index();
    if (i >= p.n) return;
    unsigned ia = i, ib = i;
    if (A_MODE == STRIDED || B_MODE == STRIDED) {
        unsigned rem = i, oa = 0, ob = 0;
        for (unsigned d = p.ndim; d > 0;) {
            d--;
            unsigned extent = p.shape[d];
            unsigned index = rem % extent;
            rem /= extent;
            oa += index * p.a_strides[d];
            ob += index * p.b_strides[d];
        }
        if (A_MODE == STRIDED) ia = oa;
        if (B_MODE == STRIDED) ib = p.b_base + ob;
    }
    if (A_MODE == SCALAR) ia = 0;
    if (B_MODE == SCALAR) ib = 0;
    out[i] = CVT(O, binary_op(CVT(C, a[ia]), CVT(C, b[ib])));
}
