// Strided copy with dtype conversion; mirrors shaders/wgsl/copy.wgsl. A (source), O (destination),
// C (compute type of A).

//!interface

extern "C" __global__ void strided_copy(BG_ARGS) {
    unsigned i = bg_thread_index();
    if (i >= p.n) return;
    unsigned rem = i;
    int s = p.src_base, t = p.dst_base;
    for (unsigned d = p.ndim; d > 0;) {
        d--;
        unsigned extent = p.shape[d];
        int index = (int)(rem % extent);
        rem /= extent;
        s += index * p.src_strides[d];
        t += index * p.dst_strides[d];
    }
    dst[(unsigned)t] = CVT(O, CVT(C, src[(unsigned)s]));
}
