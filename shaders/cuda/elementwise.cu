// Elementwise ops; mirrors shaders/wgsl/elementwise.wgsl. Defined above: A, B (inputs), O (output),
// C (compute type), UNARY_EXPR (of x), BINARY_EXPR (of x, y), A_MODE, B_MODE (0: read at the output
// index, 1: broadcast scalar, 2: read through broadcast strides).

#ifndef A_MODE
#define A_MODE 0
#endif
#ifndef B_MODE
#define B_MODE 0
#endif
#ifndef UNARY_EXPR
#define UNARY_EXPR x
#endif
#ifndef BINARY_EXPR
#define BINARY_EXPR x
#endif

struct Params {
    unsigned n, ndim, pad0, pad1;
    unsigned shape[8];
    unsigned a_strides[8];
    unsigned b_strides[8];
};

__device__ __forceinline__ C unary_op(C x) { return UNARY_EXPR; }
__device__ __forceinline__ C binary_op(C x, C y) { return BINARY_EXPR; }

extern "C" __global__ void unary(const A* a, const B* b, O* out, const Params p) {
    unsigned i = bg_thread_index();
    if (i >= p.n) return;
    out[i] = CVT(O, unary_op(CVT(C, a[i])));
}

extern "C" __global__ void binary(const A* a, const B* b, O* out, const Params p) {
    unsigned i = bg_thread_index();
    if (i >= p.n) return;
    unsigned ia = i, ib = i;
    if (A_MODE == 2 || B_MODE == 2) {
        unsigned rem = i, oa = 0, ob = 0;
        for (unsigned d = p.ndim; d > 0;) {
            d--;
            unsigned extent = p.shape[d];
            unsigned index = rem % extent;
            rem /= extent;
            oa += index * p.a_strides[d];
            ob += index * p.b_strides[d];
        }
        if (A_MODE == 2) ia = oa;
        if (B_MODE == 2) ib = ob;
    }
    if (A_MODE == 1) ia = 0;
    if (B_MODE == 1) ib = 0;
    out[i] = CVT(O, binary_op(CVT(C, a[ia]), CVT(C, b[ib])));
}
