// Row gathers; mirrors shaders/wgsl/gather.wgsl. embedding: out[i, :] = table[ids[i], :] (ids outside
// [0, rows) give zeros), also from quantized tables; argmax_rows: index of the first maximum of each
// row. A (table / input type), O (output type), C (compute type of A).

struct Params {
    unsigned count;  // embedding: number of ids; argmax: rows
    unsigned width;  // embedding: row width; argmax: row length
    unsigned rows;   // embedding: table rows
    unsigned pad;
};

extern "C" __global__ void embedding(const int* ids, const A* table, O* out, const Params p, int* indices,
                                     const unsigned* qtable) {
    unsigned i = bg_thread_index();
    if (i >= p.count * p.width) return;
    int id = ids[i / p.width];
    O value = CVT(O, 0);
    if (id >= 0 && (unsigned)id < p.rows) value = CVT(O, table[(unsigned)id * p.width + i % p.width]);
    out[i] = value;
}

// One weight of a quantized table (batchgpu/quant.py layout): row id, column c.
__device__ __forceinline__ float q4_1_weight(const unsigned* qtable, const Params& p, unsigned id, unsigned c) {
    unsigned at = (id * (p.width / 32u) + c / 32u) * 5u;
    unsigned scales = qtable[at];
    unsigned j = c % 32u;
    unsigned byte = (qtable[at + 1u + (j % 16u) / 4u] >> (8u * (j % 4u))) & 0xFFu;
    unsigned q = j >= 16u ? byte >> 4u : byte & 0x0Fu;
    return bg_bits2f(scales & 0xFFFFu) * (float)q + bg_bits2f(scales >> 16u);
}

__device__ __forceinline__ float q8_0_weight(const unsigned* qtable, const Params& p, unsigned id, unsigned c) {
    unsigned at = (id * (p.width / 32u) + c / 32u) * 9u;
    unsigned j = c % 32u;
    int q = (int)(signed char)((qtable[at + 1u + j / 4u] >> (8u * (j % 4u))) & 0xFFu);
    return bg_bits2f(qtable[at] & 0xFFFFu) * (float)q;
}

// A quantized-table embedding: ids outside [0, rows) give zeros.
template <bool Q8>
__device__ void embed_quantized(const int* ids, O* out, const Params& p, const unsigned* qtable) {
    unsigned i = bg_thread_index();
    if (i >= p.count * p.width) return;
    int id = ids[i / p.width];
    float value = 0.0f;
    if (id >= 0 && (unsigned)id < p.rows) {
        value = Q8 ? q8_0_weight(qtable, p, (unsigned)id, i % p.width) : q4_1_weight(qtable, p, (unsigned)id, i % p.width);
    }
    out[i] = CVT(O, value);
}

extern "C" __global__ void embedding_q4_1(const int* ids, const A* table, O* out, const Params p, int* indices,
                                          const unsigned* qtable) {
    embed_quantized<false>(ids, out, p, qtable);
}

extern "C" __global__ void embedding_q8_0(const int* ids, const A* table, O* out, const Params p, int* indices,
                                          const unsigned* qtable) {
    embed_quantized<true>(ids, out, p, qtable);
}

extern "C" __global__ void argmax_rows(const int* ids, const A* table, O* out, const Params p, int* indices,
                                       const unsigned* qtable) {
    __shared__ C best_value[WG];
    __shared__ unsigned best_index[WG];
    unsigned lid = threadIdx.x;
    unsigned row = bg_block_index();
    unsigned base = bg_min(row, p.count - 1u) * p.width;
    C value = CVT(C, table[base]);
    unsigned index = 0;
    for (unsigned k = lid; k < p.width; k += WG) {
        C v = CVT(C, table[base + k]);
        if (v > value) {
            value = v;
            index = k;
        }
    }
    best_value[lid] = value;
    best_index[lid] = index;
    __syncthreads();
    for (unsigned stride = WG / 2; stride > 0; stride >>= 1) {
        if (lid < stride) {
            C v = best_value[lid + stride];
            unsigned k = best_index[lid + stride];
            if (v > best_value[lid] || (v == best_value[lid] && k < best_index[lid])) {
                best_value[lid] = v;
                best_index[lid] = k;
            }
        }
        __syncthreads();
    }
    if (lid == 0 && row < p.count) indices[row] = (int)best_index[0];
}
