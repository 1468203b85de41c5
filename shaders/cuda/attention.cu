// Decoder attention pieces; mirrors shaders/wgsl/attention.wgsl. Positions come from the per-execute
// scalars (a device buffer of 64 u32 slots) or a literal. A (tensor storage type).
// Unlike WGSL (SMAX / HEAD_DIM override constants), the scores and the scaled query row of attention and
// attention_partial live in dynamic shared memory sized at launch: 4 * (split_rows + head_dim) bytes
// (split_rows: the cache length when one workgroup takes all its rows, else one block's rows), so one
// module serves every cache length.

//!interface

struct RowStats {
    float top, total;  // the largest score and the sum of exp(score - top)
};

__device__ __forceinline__ unsigned position(const Params& p, const unsigned* scalars) {
    return p.pos_slot == NO_SLOT ? p.pos_literal : scalars[p.pos_slot];
}

extern "C" __global__ void rope(BG_ARGS) {
    unsigned half = p.head_dim / 2u;
    unsigned i = bg_thread_index();
    if (i >= p.tokens * p.heads * half) return;
    unsigned j = i % half;
    unsigned row = i / half;  // token * heads + head
    unsigned t = row / p.heads;
    float turns = (float)(position(p, scalars) + t) * table[j] / TWO_PI;
    float angle = (turns - rintf(turns)) * TWO_PI;  // reduced to [-pi, pi] where cos/sin are accurate
    float c = cosf(angle), s = sinf(angle);
    unsigned base = row * p.head_dim;
    float x1 = CVT(float, src[base + j]);
    float x2 = CVT(float, src[base + j + half]);
    dst[base + j] = CVT(A, x1 * c - x2 * s);
    dst[base + j + half] = CVT(A, x2 * c + x1 * s);
}

extern "C" __global__ void kv_write(BG_ARGS) {
    unsigned row = p.kv_heads * p.head_dim;
    unsigned i = bg_thread_index();
    if (i >= p.tokens * row) return;
    unsigned target_row = position(p, scalars) + i / row;
    if (target_row >= p.cache_len) return;
    dst[target_row * row + i % row] = src[i];
}

// Rows of the cache token t sees: [0, pos + t] when causal, else [0, pos + tokens).
__device__ __forceinline__ unsigned visible_rows(const Params& p, const unsigned* scalars, unsigned t) {
    unsigned start = position(p, scalars);
    return p.causal != 0u ? bg_min(start + t + 1u, p.cache_len) : bg_min(start + p.tokens, p.cache_len);
}

// Offset of item (token * heads + head)'s kv head within a cache row.
__device__ __forceinline__ unsigned kv_offset(const Params& p, unsigned item) {
    return (item % p.heads) / (p.heads / p.kv_heads) * p.head_dim;
}

// Scores of item's query over cache rows [first, last) (at most split_rows): scores[j - first] =
// exp(score_j - top); returns (top, sum of exp), (LOWEST, 0) for no rows. Every thread of the block
// calls it (barriers).
__device__ RowStats softmax_rows(const A* src, const A* keys, const Params& p, float* scores, float* q_row,
                               float* partial, unsigned lid, unsigned item, unsigned first, unsigned last) {
    unsigned row = p.kv_heads * p.head_dim;
    unsigned offset = kv_offset(p, item);
    for (unsigned d = lid; d < p.head_dim; d += WG) q_row[d] = CVT(float, src[item * p.head_dim + d]) * p.scale;
    __syncthreads();
    float best = LOWEST;
    for (unsigned j = first + lid; j < last; j += WG) {
        float s = 0.0f;
        for (unsigned d = 0; d < p.head_dim; d++) s += q_row[d] * CVT(float, keys[j * row + offset + d]);
        scores[j - first] = s;
        best = fmaxf(best, s);
    }
    float top = bg_tree(partial, lid, best, true);
    float mass = 0.0f;
    for (unsigned j = first + lid; j < last; j += WG) {
        float e = expf(scores[j - first] - top);
        scores[j - first] = e;
        mass += e;
    }
    RowStats stats;
    stats.top = top;
    stats.total = bg_tree(partial, lid, mass, false);
    return stats;
}

// Sum over cache rows [first, last) of scores[j - first] * v[j][d] for item's kv head.
__device__ float weighted_values(const A* values, const Params& p, const float* scores, unsigned item,
                                 unsigned first, unsigned last, unsigned d) {
    unsigned row = p.kv_heads * p.head_dim;
    unsigned column = kv_offset(p, item) + d;
    float acc = 0.0f;
    for (unsigned j = first; j < last; j++) acc += scores[j - first] * CVT(float, values[j * row + column]);
    return acc;
}

extern "C" __global__ void attention(BG_ARGS) {
    extern __shared__ float bg_dynamic[];
    __shared__ float partial[WG];
    float* scores = bg_dynamic;                 // [split_rows]
    float* q_row = bg_dynamic + p.split_rows;  // [head_dim]
    unsigned lid = threadIdx.x;
    unsigned item = bg_block_index();  // token * heads + head
    bool valid = item < p.tokens * p.heads;
    unsigned it = bg_min(item, p.tokens * p.heads - 1u);
    unsigned count = visible_rows(p, scalars, it / p.heads);
    RowStats stats = softmax_rows(src, keys, p, scores, q_row, partial, lid, it, 0u, count);
    if (!valid) return;
    for (unsigned d = lid; d < p.head_dim; d += WG) {
        dst[it * p.head_dim + d] = CVT(A, weighted_values(values, p, scores, it, 0u, count, d) / stats.total);
    }
}

extern "C" __global__ void attention_partial(BG_ARGS) {
    extern __shared__ float bg_dynamic[];
    __shared__ float partial[WG];
    float* scores = bg_dynamic;                 // [split_rows]
    float* q_row = bg_dynamic + p.split_rows;  // [head_dim]
    unsigned lid = threadIdx.x;
    unsigned blocks = p.tokens * p.heads * p.splits;
    unsigned block = bg_block_index();  // (token * heads + head) * splits + split
    bool valid = block < blocks;
    unsigned b = bg_min(block, blocks - 1u);
    unsigned it = b / p.splits;
    unsigned first = (b % p.splits) * p.split_rows;
    unsigned last = bg_min(bg_max(visible_rows(p, scalars, it / p.heads), first), first + p.split_rows);
    RowStats stats = softmax_rows(src, keys, p, scores, q_row, partial, lid, it, first, last);
    if (!valid) return;
    unsigned base = b * (p.head_dim + PARTIAL_HEADER);
    if (lid == 0u) {
        partials_out[base] = stats.top;
        partials_out[base + 1u] = stats.total;
    }
    for (unsigned d = lid; d < p.head_dim; d += WG) {
        partials_out[base + PARTIAL_HEADER + d] = weighted_values(values, p, scores, it, first, last, d);
    }
}

// Folds of partials_in [first, last) (indices of partials): the largest max, the sum of the sums and
// the weighted sums at d, each partial rescaled by exp(its max - top).
__device__ float folded_max(const float* partials_in, const Params& p, unsigned first, unsigned last) {
    float top = LOWEST;
    for (unsigned s = first; s < last; s++) top = fmaxf(top, partials_in[s * (p.head_dim + PARTIAL_HEADER)]);
    return top;
}

__device__ float folded_sum(const float* partials_in, const Params& p, unsigned first, unsigned last, float top) {
    float total = 0.0f;
    for (unsigned s = first; s < last; s++) {
        unsigned base = s * (p.head_dim + PARTIAL_HEADER);
        total += expf(partials_in[base] - top) * partials_in[base + 1u];
    }
    return total;
}

__device__ float folded_values(const float* partials_in, const Params& p, unsigned first, unsigned last, float top,
                               unsigned d) {
    float acc = 0.0f;
    for (unsigned s = first; s < last; s++) {
        unsigned base = s * (p.head_dim + PARTIAL_HEADER);
        acc += expf(partials_in[base] - top) * partials_in[base + PARTIAL_HEADER + d];
    }
    return acc;
}

extern "C" __global__ void attention_merge(BG_ARGS) {
    unsigned folded = (p.splits + p.fan_in - 1u) / p.fan_in;  // partials per (token, head) after this pass
    unsigned fold = bg_block_index();  // (token * heads + head) * folded + fold of this block
    if (fold >= p.tokens * p.heads * folded) return;
    unsigned it = fold / folded;
    unsigned first = it * p.splits + (fold % folded) * p.fan_in;
    unsigned last = bg_min(first + p.fan_in, (it + 1u) * p.splits);
    float top = folded_max(partials_in, p, first, last);
    unsigned base = fold * (p.head_dim + PARTIAL_HEADER);
    if (threadIdx.x == 0u) {
        partials_out[base] = top;
        partials_out[base + 1u] = folded_sum(partials_in, p, first, last, top);
    }
    for (unsigned d = threadIdx.x; d < p.head_dim; d += WG) {
        partials_out[base + PARTIAL_HEADER + d] = folded_values(partials_in, p, first, last, top, d);
    }
}

extern "C" __global__ void attention_combine(BG_ARGS) {
    unsigned it = bg_block_index();  // token * heads + head
    if (it >= p.tokens * p.heads) return;
    unsigned first = it * p.splits;
    unsigned last = first + p.splits;
    float top = folded_max(partials_in, p, first, last);
    float total = folded_sum(partials_in, p, first, last, top);
    for (unsigned d = threadIdx.x; d < p.head_dim; d += WG) {
        dst[it * p.head_dim + d] = CVT(A, folded_values(partials_in, p, first, last, top, d) / total);
    }
}
