// Numerically stable softmax over the middle extent of an (outer, r, inner) view, in float;
// mirrors shaders/wgsl/softmax.wgsl. A (input), O (output).

struct Params {
    unsigned outer, r, inner;
    float scale;
    unsigned chunk, chunks, pad0, pad1;
};

extern "C" __global__ void softmax_rows(const A* a, O* out, const Params p) {
    __shared__ float partial[WG];
    unsigned lid = threadIdx.x;
    unsigned row = bg_block_index();
    bool valid = row < p.outer;
    unsigned base = bg_min(row, p.outer - 1u) * p.r;
    float m = CVT(float, a[base]);
    for (unsigned k = lid; k < p.r; k += WG) m = fmaxf(m, CVT(float, a[base + k]));
    float row_max = bg_tree(partial, lid, m, true);
    float s = 0.0f;
    for (unsigned k = lid; k < p.r; k += WG) s += expf(CVT(float, a[base + k]) - row_max);
    float total = bg_tree(partial, lid, s, false);
    if (!valid) return;
    for (unsigned k = lid; k < p.r; k += WG) out[base + k] = CVT(O, expf(CVT(float, a[base + k]) - row_max) / total);
}

extern "C" __global__ void softmax_cols(const A* a, O* out, const Params p) {
    unsigned i = bg_thread_index();
    if (i >= p.outer * p.inner) return;
    unsigned base = (i / p.inner) * p.r * p.inner + i % p.inner;
    float m = CVT(float, a[base]);
    for (unsigned k = 0; k < p.r; k++) m = fmaxf(m, CVT(float, a[base + k * p.inner]));
    float s = 0.0f;
    for (unsigned k = 0; k < p.r; k++) s += expf(CVT(float, a[base + k * p.inner]) - m);
    for (unsigned k = 0; k < p.r; k++) {
        out[base + k * p.inner] = CVT(O, expf(CVT(float, a[base + k * p.inner]) - m) / s);
    }
}
