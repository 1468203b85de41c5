// Row normalizations, sums in float; mirrors shaders/wgsl/norm.wgsl. A (storage type of every tensor).
// extra: layer_norm bias, or add_rms_norm's residual. *_rows: one block per row; longer rows, one block per
// (row, piece of p.chunk elements), in two passes: *_partials write per-piece statistics to `partials`,
// *_chunks combine the row's partials and write their piece.

//!interface

extern "C" __global__ void rms_norm_rows(BG_ARGS) {
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

extern "C" __global__ void add_rms_norm_rows(BG_ARGS) {
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

extern "C" __global__ void layer_norm_rows(BG_ARGS) {
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

// Long rows ---------------------------------------------------------------------------------------

// A piece of a long row: block `index` takes piece index % chunks of row index / chunks.
__device__ __forceinline__ unsigned chunks(const Params& p) { return (p.d - 1u) / p.chunk + 1u; }

__device__ __forceinline__ BgPiece piece_of(const Params& p) {
    return bg_piece_at(bg_block_index(), p.rows, p.d, p.chunk);
}

extern "C" __global__ void rms_norm_partials(BG_ARGS) {
    __shared__ float partial[WG];
    unsigned lid = threadIdx.x;
    BgPiece piece = piece_of(p);
    unsigned base = piece.row * p.d + piece.first;
    float squares = 0.0f;
    for (unsigned k = lid; k < piece.count; k += WG) {
        float v = CVT(float, x[base + k]);
        squares += v * v;
    }
    float piece_squares = bg_tree(partial, lid, squares, false);
    if (lid == 0 && piece.valid) partials[piece.index] = piece_squares;
}

extern "C" __global__ void add_rms_norm_partials(BG_ARGS) {
    __shared__ float partial[WG];
    unsigned lid = threadIdx.x;
    BgPiece piece = piece_of(p);
    unsigned base = piece.row * p.d + piece.first;
    float squares = 0.0f;
    for (unsigned k = lid; k < piece.count; k += WG) {
        float v = CVT(float, x[base + k]) + CVT(float, extra[base + k]);
        squares += v * v;
        if (piece.valid) summed[base + k] = CVT(A, v);
    }
    float piece_squares = bg_tree(partial, lid, squares, false);
    if (lid == 0 && piece.valid) partials[piece.index] = piece_squares;
}

// rsqrt(mean(x^2) + eps) of the piece's row, from its pieces' sums of squares.
__device__ float rms_scale(float* partial, unsigned lid, const BgPiece& piece, const Params& p, const float* partials) {
    unsigned first = piece.row * chunks(p);
    float squares = 0.0f;
    for (unsigned j = lid; j < chunks(p); j += WG) squares += partials[first + j];
    return rsqrtf(bg_tree(partial, lid, squares, false) / (float)p.d + p.eps);
}

extern "C" __global__ void rms_norm_chunks(BG_ARGS) {
    __shared__ float partial[WG];
    unsigned lid = threadIdx.x;
    BgPiece piece = piece_of(p);
    float scale = rms_scale(partial, lid, piece, p, partials);
    if (!piece.valid) return;
    unsigned base = piece.row * p.d + piece.first;
    for (unsigned k = lid; k < piece.count; k += WG) {
        out[base + k] = CVT(A, CVT(float, x[base + k]) * scale * CVT(float, w[piece.first + k]));
    }
}

extern "C" __global__ void add_rms_norm_chunks(BG_ARGS) {
    __shared__ float partial[WG];
    unsigned lid = threadIdx.x;
    BgPiece piece = piece_of(p);
    float scale = rms_scale(partial, lid, piece, p, partials);
    if (!piece.valid) return;
    unsigned base = piece.row * p.d + piece.first;
    for (unsigned k = lid; k < piece.count; k += WG) {
        float v = CVT(float, x[base + k]) + CVT(float, extra[base + k]);
        out[base + k] = CVT(A, v * scale * CVT(float, w[piece.first + k]));
    }
}

extern "C" __global__ void layer_norm_partials(BG_ARGS) {
    __shared__ float partial[WG];
    unsigned lid = threadIdx.x;
    BgPiece piece = piece_of(p);
    unsigned base = piece.row * p.d + piece.first;
    float total = 0.0f;
    for (unsigned k = lid; k < piece.count; k += WG) total += CVT(float, x[base + k]);
    float piece_total = bg_tree(partial, lid, total, false);
    float mean = piece_total / (float)piece.count;
    float deviations = 0.0f;
    for (unsigned k = lid; k < piece.count; k += WG) {
        float c = CVT(float, x[base + k]) - mean;
        deviations += c * c;
    }
    float piece_deviations = bg_tree(partial, lid, deviations, false);
    if (lid == 0 && piece.valid) {
        partials[2u * piece.index] = piece_total;
        partials[2u * piece.index + 1u] = piece_deviations;
    }
}

struct LayerStats {
    float mean, scale;
};

// (mean, rsqrt(var + eps)) of the piece's row from its pieces' (sum, squared deviations) partials, with
// Chan et al.'s parallel formula: row deviations = sum over pieces of (deviations + n * (piece mean - mean)^2).
__device__ LayerStats layer_stats(float* partial, unsigned lid, const BgPiece& piece, const Params& p,
                                  const float* partials) {
    unsigned first = piece.row * chunks(p);
    float total = 0.0f;
    for (unsigned j = lid; j < chunks(p); j += WG) total += partials[2u * (first + j)];
    float mean = bg_tree(partial, lid, total, false) / (float)p.d;
    float deviations = 0.0f;
    for (unsigned j = lid; j < chunks(p); j += WG) {
        float n = (float)bg_min(p.chunk, p.d - j * p.chunk);
        float offset = partials[2u * (first + j)] / n - mean;
        deviations += partials[2u * (first + j) + 1u] + n * offset * offset;
    }
    return LayerStats{mean, rsqrtf(bg_tree(partial, lid, deviations, false) / (float)p.d + p.eps)};
}

extern "C" __global__ void layer_norm_chunks(BG_ARGS) {
    __shared__ float partial[WG];
    unsigned lid = threadIdx.x;
    BgPiece piece = piece_of(p);
    LayerStats stats = layer_stats(partial, lid, piece, p, partials);
    if (!piece.valid) return;
    unsigned base = piece.row * p.d + piece.first;
    for (unsigned k = lid; k < piece.count; k += WG) {
        unsigned c = piece.first + k;
        float normed = (CVT(float, x[base + k]) - stats.mean) * stats.scale;
        out[base + k] = CVT(A, normed * CVT(float, w[c]) + CVT(float, extra[c]));
    }
}
