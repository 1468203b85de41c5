// Numerically stable softmax over the middle extent of an (outer, r, inner) view, in float;
// mirrors shaders/wgsl/softmax.wgsl. A (input), O (output). softmax_rows: one block per row;
// softmax_partials and softmax_chunks: rows longer than one chunk, one block per (row, piece), in two
// passes over per-piece (max, sum of exp(x - max)) partials; softmax_cols: one thread per column.

//!interface

extern "C" __global__ void softmax_rows(BG_ARGS) {
    __shared__ float partial[WG];
    unsigned lid = threadIdx.x;
    unsigned row = bg_block_index();
    bool valid = row < p.outer;
    unsigned base = bg_min(row, p.outer - 1u) * p.r;
    float m = CVT(float, a[base]);
    for (unsigned k = lid; k < p.r; k += WG) m = bg_max_nan(m, CVT(float, a[base + k]));
    float row_max = bg_tree(partial, lid, m, true);
    float s = 0.0f;
    for (unsigned k = lid; k < p.r; k += WG) s += expf(CVT(float, a[base + k]) - row_max);
    float total = bg_tree(partial, lid, s, false);
    if (!valid) return;
    for (unsigned k = lid; k < p.r; k += WG) out[base + k] = CVT(O, expf(CVT(float, a[base + k]) - row_max) / total);
}

// A piece of a long row: block `index` takes piece index % chunks of row index / chunks.
__device__ __forceinline__ BgPiece piece_of(const Params& p) {
    return bg_piece_at(bg_block_index(), p.outer, p.r, p.chunk);
}

extern "C" __global__ void softmax_partials(BG_ARGS) {
    __shared__ float partial[WG];
    unsigned lid = threadIdx.x;
    BgPiece piece = piece_of(p);
    unsigned base = piece.row * p.r + piece.first;
    float m = CVT(float, a[base]);
    for (unsigned k = lid; k < piece.count; k += WG) m = bg_max_nan(m, CVT(float, a[base + k]));
    float piece_max = bg_tree(partial, lid, m, true);
    float s = 0.0f;
    for (unsigned k = lid; k < piece.count; k += WG) s += expf(CVT(float, a[base + k]) - piece_max);
    float piece_sum = bg_tree(partial, lid, s, false);
    if (lid == 0 && piece.valid) {
        partials[2u * piece.index] = piece_max;
        partials[2u * piece.index + 1u] = piece_sum;
    }
}

struct RowStats {
    float max, sum;
};

// (max, sum of exp(x - max)) of the piece's row from its pieces' partials. A piece of -inf only (its sum is
// NaN) adds nothing.
__device__ RowStats row_max_and_sum(float* partial, unsigned lid, const BgPiece& piece, const Params& p,
                                    const float* partials) {
    unsigned first = piece.row * p.chunks;
    float m = partials[2u * first];
    for (unsigned j = lid; j < p.chunks; j += WG) m = bg_max_nan(m, partials[2u * (first + j)]);
    float row_max = bg_tree(partial, lid, m, true);
    float s = 0.0f;
    for (unsigned j = lid; j < p.chunks; j += WG) {
        float piece_max = partials[2u * (first + j)];
        if (!(piece_max < -3.4028234e38f)) s += partials[2u * (first + j) + 1u] * expf(piece_max - row_max);
    }
    return RowStats{row_max, bg_tree(partial, lid, s, false)};
}

extern "C" __global__ void softmax_chunks(BG_ARGS) {
    __shared__ float partial[WG];
    unsigned lid = threadIdx.x;
    BgPiece piece = piece_of(p);
    RowStats row_stats = row_max_and_sum(partial, lid, piece, p, partials);
    if (!piece.valid) return;
    unsigned base = piece.row * p.r + piece.first;
    for (unsigned k = lid; k < piece.count; k += WG) {
        out[base + k] = CVT(O, expf(CVT(float, a[base + k]) - row_stats.max) / row_stats.sum);
    }
}

extern "C" __global__ void softmax_cols(BG_ARGS) {
    unsigned i = bg_thread_index();
    if (i >= p.outer * p.inner) return;
    unsigned base = (i / p.inner) * p.r * p.inner + i % p.inner;
    float m = CVT(float, a[base]);
    for (unsigned k = 0; k < p.r; k++) m = bg_max_nan(m, CVT(float, a[base + k * p.inner]));
    float s = 0.0f;
    for (unsigned k = 0; k < p.r; k++) s += expf(CVT(float, a[base + k * p.inner]) - m);
    for (unsigned k = 0; k < p.r; k++) {
        out[base + k * p.inner] = CVT(O, expf(CVT(float, a[base + k * p.inner]) - m) / s);
    }
}
