// Decoder attention pieces; mirrors shaders/wgsl/attention.wgsl. Positions come from the per-execute
// scalars (a device buffer of 64 u32 slots) or a literal. A (tensor storage type: x, q, output, caches
// written), B (keys and values read).
// Unlike WGSL (SMAX / HEAD_DIM override constants), the scores and the scaled query row of attention and
// attention_partial live in dynamic shared memory sized at launch: 4 * (split_rows + head_dim) bytes
// (split_rows: the cache length when one workgroup takes all its rows, else one block's rows), so one
// module serves every cache length. The paged kernels keep them in a static array of ROWS_SHARED floats
// (split_rows + head_dim fit it by construction: bounds.WORKGROUP_BYTES).

//!interface

struct RowStats {
    float top, total;  // the largest score and the sum of exp(score - top)
};

__device__ __forceinline__ unsigned position(const Params& p, const unsigned* scalars) {
    return p.pos_slot == NO_SLOT ? p.pos_literal : scalars[p.pos_slot];
}

struct Rotation {
    float c, s;
};

// The rope arithmetic every form (rope, rope_positions, rope_kv_write, rope_kv_scatter) shares, with each
// rounding spelled out: __fmul_rn / __fdiv_rn (PTX mul.rn / div.rn, which are never contracted) and fmaf
// (fma.rn) where the sums are. Plain a * b + c lets NVRTC (-fmad=true) and ptxas contract either product
// into an fma, and they chose differently in rope_kv_write than in rope: 1 ulp apart. Written out, the
// fused and unfused forms give the same bits.

// cos and sin of the rotation of pair j at position `at` (see the WGSL twin: the f32 angle, reduced by
// whole turns with 2 pi in two parts).
__device__ __forceinline__ Rotation rotation(const float* table, unsigned j, float at) {
    float angle = __fmul_rn(at, table[j]);
    float turns = rintf(__fdiv_rn(angle, TWO_PI));
    float reduced = fmaf(-turns, TWO_PI_LO, fmaf(-turns, TWO_PI_HI, angle));
    return Rotation{cosf(reduced), sinf(reduced)};
}

struct Pair {
    float first, second;
};

// The pair (x1, x2) rotated by r: (x1 c - x2 s, x2 c + x1 s), each an fma of a rounded product.
__device__ __forceinline__ Pair rotated(float x1, float x2, Rotation r) {
    return Pair{fmaf(x1, r.c, -__fmul_rn(x2, r.s)), fmaf(x2, r.c, __fmul_rn(x1, r.s))};
}

// Rotates the pair (j, j + half) of row `row` (token * heads + head) of x by position `at`.
__device__ __forceinline__ void rotate(const A* src, const float* table, A* dst, const Params& p, unsigned row,
                                       unsigned j, float at) {
    unsigned half = p.head_dim / 2u;
    unsigned base = row * p.head_dim;
    Pair out = rotated(CVT(float, src[base + j]), CVT(float, src[base + j + half]), rotation(table, j, at));
    dst[base + j] = CVT(A, out.first);
    dst[base + j + half] = CVT(A, out.second);
}

extern "C" __global__ void rope(BG_ARGS) {
    unsigned half = p.head_dim / 2u;
    unsigned i = bg_thread_index();
    if (i >= p.tokens * p.heads * half) return;
    unsigned row = i / half;  // token * heads + head
    rotate(src, table, dst, p, row, i % half, (float)(position(p, scalars) + row / p.heads));
}

extern "C" __global__ void rope_positions(BG_ARGS) {
    unsigned half = p.head_dim / 2u;
    unsigned i = bg_thread_index();
    if (i >= p.tokens * p.heads * half) return;
    unsigned row = i / half;  // token * heads + head
    rotate(src, table, dst, p, row, i % half, (float)indices[row / p.heads]);
}

// rope_kv_write / rope_kv_scatter (see the WGSL twin): q heads of the fused projection rotated into dst, k
// heads rotated and v heads copied into the caches keys_out / values_out at row pos + token, or at
// position indices[token] into row rows[token] (negative: skipped).
__device__ __forceinline__ void rope_kv(const A* src, const float* table, A* dst, B* keys_out, B* values_out,
                                        const int* indices, const int* rows, const Params& p,
                                        const unsigned* scalars, bool scatter) {
    unsigned half = p.head_dim / 2u, width = p.heads + 2u * p.kv_heads;
    unsigned i = bg_thread_index();
    if (i >= p.tokens * width * half) return;
    unsigned j = i % half, row = i / half, token = row / width, head = row % width;
    unsigned target;
    float at;
    if (scatter) {
        at = (float)indices[token];
        target = (unsigned)rows[token];  // a negative row converts to at least 2^31: skipped
    } else {
        target = position(p, scalars) + token;
        at = (float)target;
    }
    unsigned base = row * p.head_dim;
    float x1 = CVT(float, src[base + j]);
    float x2 = CVT(float, src[base + j + half]);
    if (head >= p.heads + p.kv_heads) {  // v: copied
        if (target >= p.cache_len) return;
        unsigned out = (target * p.kv_heads + head - p.heads - p.kv_heads) * p.head_dim;
        values_out[out + j] = CVT(B, x1);
        values_out[out + j + half] = CVT(B, x2);
        return;
    }
    Pair r = rotated(x1, x2, rotation(table, j, at));
    if (head < p.heads) {  // q
        unsigned out = (token * p.heads + head) * p.head_dim;
        dst[out + j] = CVT(A, r.first);
        dst[out + j + half] = CVT(A, r.second);
    } else if (target < p.cache_len) {  // k
        unsigned out = (target * p.kv_heads + head - p.heads) * p.head_dim;
        keys_out[out + j] = CVT(B, r.first);
        keys_out[out + j + half] = CVT(B, r.second);
    }
}

extern "C" __global__ void rope_kv_write(BG_ARGS) {
    rope_kv(src, table, dst, keys_out, values_out, indices, rows, p, scalars, false);
}

extern "C" __global__ void rope_kv_scatter(BG_ARGS) {
    rope_kv(src, table, dst, keys_out, values_out, indices, rows, p, scalars, true);
}

// Element i of src's rows (kv_heads * head_dim each) into row `target_row` of dst; skipped past cache_len.
__device__ __forceinline__ void write_row_element(const A* src, A* dst, const Params& p, unsigned i,
                                                  unsigned target_row) {
    unsigned row = p.kv_heads * p.head_dim;
    if (target_row >= p.cache_len) return;
    dst[target_row * row + i % row] = src[i];
}

extern "C" __global__ void kv_write(BG_ARGS) {
    unsigned i = bg_thread_index();
    if (i >= p.tokens * p.kv_heads * p.head_dim) return;
    write_row_element(src, dst, p, i, position(p, scalars) + i / (p.kv_heads * p.head_dim));
}

extern "C" __global__ void scatter_rows(BG_ARGS) {
    unsigned i = bg_thread_index();
    if (i >= p.tokens * p.kv_heads * p.head_dim) return;
    // a negative target converts to at least 2^31, past any table (cache_len < 2^31): skipped
    write_row_element(src, dst, p, i, (unsigned)indices[i / (p.kv_heads * p.head_dim)]);
}

// Rows of the cache token t sees: [0, pos + t] when causal, else [0, pos + tokens).
__device__ __forceinline__ unsigned visible_rows(const Params& p, const unsigned* scalars, unsigned t) {
    unsigned start = position(p, scalars);
    return p.causal != 0u ? bg_min(start + t + 1u, p.cache_len) : bg_min(start + p.tokens, p.cache_len);
}

// The first row (position) a query seeing up to `end` (exclusive) sees: end - window with a sliding window
// (p.window > 0, causal), else 0.
__device__ __forceinline__ unsigned window_start(const Params& p, unsigned end) {
    return p.window == 0u || end <= p.window ? 0u : end - p.window;
}

// Offset of item (token * heads + head)'s kv head within a cache row.
__device__ __forceinline__ unsigned kv_offset(const Params& p, unsigned item) {
    return (item % p.heads) / (p.heads / p.kv_heads) * p.head_dim;
}

// q_row = item's query row times the scale. Every thread of the block calls it (a barrier).
__device__ __forceinline__ void load_query(const A* src, const Params& p, float* q_row, unsigned lid, unsigned item) {
    for (unsigned d = lid; d < p.head_dim; d += WG) q_row[d] = CVT(float, src[item * p.head_dim + d]) * p.scale;
    __syncthreads();
}

// q_row . the key of cache (pool) row r at kv-head offset `offset`.
__device__ __forceinline__ float key_score(const B* keys, const Params& p, const float* q_row, unsigned r,
                                           unsigned offset) {
    unsigned base = r * p.kv_heads * p.head_dim + offset;
    float s = 0.0f;
    for (unsigned d = 0; d < p.head_dim; d++) s += q_row[d] * CVT(float, keys[base + d]);
    return s;
}

// scores[j - first] = exp(score_j - top) over [first, last), each thread's scores and their maximum
// `best` given; returns (top, sum of exp). Every thread of the block calls it (barriers).
__device__ RowStats normalize_scores(float* scores, float* partial, unsigned lid, unsigned first, unsigned last,
                                     float best) {
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

// Scores of item's query over cache rows [first, last) (at most split_rows): scores[j - first] =
// exp(score_j - top); returns (top, sum of exp), (LOWEST, 0) for no rows. Every thread of the block
// calls it (barriers).
__device__ RowStats softmax_rows(const A* src, const B* keys, const Params& p, float* scores, float* q_row,
                               float* partial, unsigned lid, unsigned item, unsigned first, unsigned last) {
    load_query(src, p, q_row, lid, item);
    unsigned offset = kv_offset(p, item);
    float best = LOWEST;
    for (unsigned j = first + lid; j < last; j += WG) {
        float s = key_score(keys, p, q_row, j, offset);
        scores[j - first] = s;
        best = fmaxf(best, s);
    }
    return normalize_scores(scores, partial, lid, first, last, best);
}

// Sum over cache rows [first, last) of scores[j - first] * v[j][d] for item's kv head.
__device__ float weighted_values(const B* values, const Params& p, const float* scores, unsigned item,
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
    unsigned start = window_start(p, count);
    RowStats stats = softmax_rows(src, keys, p, scores, q_row, partial, lid, it, start, count);
    if (!valid) return;
    for (unsigned d = lid; d < p.head_dim; d += WG) {
        dst[it * p.head_dim + d] = CVT(A, weighted_values(values, p, scores, it, start, count, d) / stats.total);
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
    unsigned visible = visible_rows(p, scalars, it / p.heads);
    unsigned block_first = (b % p.splits) * p.split_rows;
    unsigned last = bg_min(bg_max(visible, block_first), block_first + p.split_rows);
    unsigned first = bg_min(bg_max(window_start(p, visible), block_first), last);
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

// Paged attention (mirrors the WGSL): query row n (item = n * heads + head) of sequence indices[n] attends
// over positions [0, lengths[n]) (clamped to max_blocks * block_size); position j lives in pool row
// block_tables[seq * max_blocks + j / block_size] * block_size + j % block_size. A position whose block is
// not in the pool scores LOWEST and its value row is never read; a row with no positions writes zeros.

struct PagedSpan {
    unsigned count, table_row;  // positions row n attends over, offset of its sequence's block-table row
};

__device__ __forceinline__ PagedSpan paged_span(const int* indices, const int* lengths, const Params& p, unsigned n) {
    int seq = indices[n];
    PagedSpan span = {0u, 0u};
    if (seq < 0 || (unsigned)seq >= p.sequences) return span;
    int length = lengths[n];
    int most = (int)(p.max_blocks * p.block_size);  // < 2^31
    span.count = (unsigned)(length < 0 ? 0 : length > most ? most : length);
    span.table_row = (unsigned)seq * p.max_blocks;
    return span;
}

// Pool row of position j of the sequence whose block-table row starts at `table_row`; NO_ROW when its
// block is not in the pool.
__device__ __forceinline__ unsigned pool_row(const int* block_tables, const Params& p, unsigned table_row,
                                             unsigned j) {
    int block = block_tables[table_row + j / p.block_size];
    unsigned blocks = (p.cache_len + p.block_size - 1u) / p.block_size;  // the last one may be partial
    if (block < 0 || (unsigned)block >= blocks) return NO_ROW;
    unsigned r = (unsigned)block * p.block_size + j % p.block_size;
    return r < p.cache_len ? r : NO_ROW;
}

__device__ RowStats paged_softmax(const A* src, const B* keys, const int* block_tables, const Params& p,
                                  float* scores, float* q_row, float* partial, unsigned lid, unsigned item,
                                  unsigned table_row, unsigned first, unsigned last) {
    load_query(src, p, q_row, lid, item);
    unsigned offset = kv_offset(p, item);
    float best = LOWEST;
    for (unsigned j = first + lid; j < last; j += WG) {
        unsigned r = pool_row(block_tables, p, table_row, j);
        float s = r != NO_ROW ? key_score(keys, p, q_row, r, offset) : LOWEST;
        scores[j - first] = s;
        best = fmaxf(best, s);
    }
    return normalize_scores(scores, partial, lid, first, last, best);
}

__device__ float paged_weighted_values(const B* values, const int* block_tables, const Params& p,
                                       const float* scores, unsigned item, unsigned table_row, unsigned first,
                                       unsigned last, unsigned d) {
    unsigned row = p.kv_heads * p.head_dim;
    unsigned column = kv_offset(p, item) + d;
    float acc = 0.0f;
    for (unsigned j = first; j < last; j++) {
        unsigned r = pool_row(block_tables, p, table_row, j);
        if (r != NO_ROW) acc += scores[j - first] * CVT(float, values[r * row + column]);
    }
    return acc;
}

extern "C" __global__ void paged_attention(BG_ARGS) {
    __shared__ float rows_shared[ROWS_SHARED];
    __shared__ float partial[WG];
    float* scores = rows_shared;                 // [split_rows]
    float* q_row = rows_shared + p.split_rows;  // [head_dim]
    unsigned lid = threadIdx.x;
    unsigned item = bg_block_index();  // n * heads + head
    bool valid = item < p.tokens * p.heads;
    unsigned it = bg_min(item, p.tokens * p.heads - 1u);
    PagedSpan span = paged_span(indices, lengths, p, it / p.heads);
    unsigned start = window_start(p, span.count);
    RowStats stats = paged_softmax(src, keys, block_tables, p, scores, q_row, partial, lid, it, span.table_row, start,
                                   span.count);
    if (!valid) return;
    float total = span.count == 0u ? 1.0f : stats.total;
    for (unsigned d = lid; d < p.head_dim; d += WG) {
        float acc = paged_weighted_values(values, block_tables, p, scores, it, span.table_row, start, span.count, d);
        dst[it * p.head_dim + d] = CVT(A, acc / total);
    }
}

extern "C" __global__ void paged_attention_partial(BG_ARGS) {
    __shared__ float rows_shared[ROWS_SHARED];
    __shared__ float partial[WG];
    float* scores = rows_shared;                 // [split_rows]
    float* q_row = rows_shared + p.split_rows;  // [head_dim]
    unsigned lid = threadIdx.x;
    unsigned blocks = p.tokens * p.heads * p.splits;
    unsigned block = bg_block_index();  // (n * heads + head) * splits + split
    bool valid = block < blocks;
    unsigned b = bg_min(block, blocks - 1u);
    unsigned it = b / p.splits;
    PagedSpan span = paged_span(indices, lengths, p, it / p.heads);
    unsigned block_first = (b % p.splits) * p.split_rows;
    unsigned last = bg_min(bg_max(span.count, block_first), block_first + p.split_rows);
    unsigned first = bg_min(bg_max(window_start(p, span.count), block_first), last);
    RowStats stats = paged_softmax(src, keys, block_tables, p, scores, q_row, partial, lid, it, span.table_row, first,
                                   last);
    if (!valid) return;
    unsigned base = b * (p.head_dim + PARTIAL_HEADER);
    if (lid == 0u) {
        partials_out[base] = stats.top;
        partials_out[base + 1u] = span.count == 0u ? 1.0f : stats.total;
    }
    for (unsigned d = lid; d < p.head_dim; d += WG) {
        partials_out[base + PARTIAL_HEADER + d] =
            paged_weighted_values(values, block_tables, p, scores, it, span.table_row, first, last, d);
    }
}
