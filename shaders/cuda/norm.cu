// Row normalizations, one block per row, sums in float; mirrors shaders/wgsl/norm.wgsl. A (storage
// type of every tensor). extra: layer_norm bias, or add_rms_norm's residual.

struct Params {
    unsigned rows, d;
    float eps;
    unsigned pad;
};

extern "C" __global__ void rms_norm_rows(const A* x, const A* w, const A* extra, A* out, A* summed, const Params p) {
    __shared__ float partial[WG];
    unsigned lid = threadIdx.x;
    unsigned row = bg_block_index();
    unsigned base = bg_min(row, p.rows - 1u) * p.d;
    float squares = 0.0f;
    for (unsigned k = lid; k < p.d; k += WG) {
        float v = CVT(float, x[base + k]);
        squares += v * v;
    }
    float scale = rsqrtf(bg_tree(partial, lid, squares, false) / (float)p.d + p.eps);
    if (row >= p.rows) return;
    for (unsigned k = lid; k < p.d; k += WG) out[base + k] = CVT(A, CVT(float, x[base + k]) * scale * CVT(float, w[k]));
}

extern "C" __global__ void add_rms_norm_rows(const A* x, const A* w, const A* extra, A* out, A* summed,
                                             const Params p) {
    __shared__ float partial[WG];
    unsigned lid = threadIdx.x;
    unsigned row = bg_block_index();
    bool valid = row < p.rows;
    unsigned base = bg_min(row, p.rows - 1u) * p.d;
    float squares = 0.0f;
    for (unsigned k = lid; k < p.d; k += WG) {
        float v = CVT(float, x[base + k]) + CVT(float, extra[base + k]);
        squares += v * v;
        if (valid) summed[base + k] = CVT(A, v);
    }
    float scale = rsqrtf(bg_tree(partial, lid, squares, false) / (float)p.d + p.eps);
    if (!valid) return;
    for (unsigned k = lid; k < p.d; k += WG) {
        float v = CVT(float, x[base + k]) + CVT(float, extra[base + k]);
        out[base + k] = CVT(A, v * scale * CVT(float, w[k]));
    }
}

extern "C" __global__ void layer_norm_rows(const A* x, const A* w, const A* extra, A* out, A* summed,
                                           const Params p) {
    __shared__ float partial[WG];
    unsigned lid = threadIdx.x;
    unsigned row = bg_block_index();
    unsigned base = bg_min(row, p.rows - 1u) * p.d;
    float total = 0.0f;
    for (unsigned k = lid; k < p.d; k += WG) total += CVT(float, x[base + k]);
    float mean = bg_tree(partial, lid, total, false) / (float)p.d;
    float deviations = 0.0f;
    for (unsigned k = lid; k < p.d; k += WG) {
        float c = CVT(float, x[base + k]) - mean;
        deviations += c * c;
    }
    float scale = rsqrtf(bg_tree(partial, lid, deviations, false) / (float)p.d + p.eps);
    if (row >= p.rows) return;
    for (unsigned k = lid; k < p.d; k += WG) {
        out[base + k] = CVT(A, (CVT(float, x[base + k]) - mean) * scale * CVT(float, w[k]) + CVT(float, extra[k]));
    }
}
