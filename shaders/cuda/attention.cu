// Decoder attention pieces; mirrors shaders/wgsl/attention.wgsl. Positions come from the per-execute
// scalars (a device buffer of 64 u32 slots) or a literal. A (tensor storage type).
// Unlike WGSL (SMAX / HEAD_DIM override constants), the scores and the scaled query row live in
// dynamic shared memory sized at launch: 4 * (cache_len + head_dim) bytes, so one module serves every
// cache length.

#define TWO_PI 6.283185307179586f

struct Params {
    unsigned tokens, heads, kv_heads, head_dim, cache_len, pos_slot, pos_literal, causal;
    float scale;
    unsigned pad0, pad1, pad2;
};

__device__ __forceinline__ unsigned position(const Params& p, const unsigned* scalars) {
    return p.pos_slot == BG_NO_SLOT ? p.pos_literal : scalars[p.pos_slot];
}

extern "C" __global__ void rope(const A* src, const float* table, const A* keys, const A* values, A* dst,
                                const Params p, const unsigned* scalars) {
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

extern "C" __global__ void kv_write(const A* src, const float* table, const A* keys, const A* values, A* dst,
                                    const Params p, const unsigned* scalars) {
    unsigned row = p.kv_heads * p.head_dim;
    unsigned i = bg_thread_index();
    if (i >= p.tokens * row) return;
    unsigned target_row = position(p, scalars) + i / row;
    if (target_row >= p.cache_len) return;
    dst[target_row * row + i % row] = src[i];
}

extern "C" __global__ void attention(const A* src, const float* table, const A* keys, const A* values, A* dst,
                                     const Params p, const unsigned* scalars) {
    extern __shared__ float bg_dynamic[];
    __shared__ float partial[WG];
    float* scores = bg_dynamic;             // [cache_len]
    float* q_row = bg_dynamic + p.cache_len;  // [head_dim]
    unsigned lid = threadIdx.x;
    unsigned item = bg_block_index();  // token * heads + head
    bool valid = item < p.tokens * p.heads;
    unsigned it = bg_min(item, p.tokens * p.heads - 1u);
    unsigned t = it / p.heads;
    unsigned kv_head = (it % p.heads) / (p.heads / p.kv_heads);
    unsigned start = position(p, scalars);
    unsigned count = bg_min(start + p.tokens, p.cache_len);
    if (p.causal != 0u) count = bg_min(start + t + 1u, p.cache_len);
    unsigned row = p.kv_heads * p.head_dim;
    unsigned head_offset = kv_head * p.head_dim;

    for (unsigned d = lid; d < p.head_dim; d += WG) q_row[d] = CVT(float, src[it * p.head_dim + d]) * p.scale;
    __syncthreads();
    float best = -3.4028234e38f;
    for (unsigned j = lid; j < count; j += WG) {
        float s = 0.0f;
        for (unsigned d = 0; d < p.head_dim; d++) s += q_row[d] * CVT(float, keys[j * row + head_offset + d]);
        scores[j] = s;
        best = fmaxf(best, s);
    }
    float top = bg_tree(partial, lid, best, true);
    float mass = 0.0f;
    for (unsigned j = lid; j < count; j += WG) {
        float e = expf(scores[j] - top);
        scores[j] = e;
        mass += e;
    }
    float total = bg_tree(partial, lid, mass, false);
    if (!valid) return;
    for (unsigned d = lid; d < p.head_dim; d += WG) {
        float acc = 0.0f;
        for (unsigned j = 0; j < count; j++) acc += scores[j] * CVT(float, values[j * row + head_offset + d]);
        dst[it * p.head_dim + d] = CVT(A, acc / total);
    }
}
