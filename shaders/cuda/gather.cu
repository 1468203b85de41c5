// Row gathers; mirrors shaders/wgsl/gather.wgsl. embedding: out[i, :] = table[ids[i], :] (ids outside
// [0, rows) give zeros), also from quantized tables; argmax_rows: index of the first maximum (NaN first,
// as numpy) of each row, or of each piece of p.chunk elements of a longer row; argmax_candidates: for long
// rows, the best of each row's pieces' candidates. A (table / input type), O (output type), C (compute type
// of A). NaN counts for float data only (prelude.cuh's bg_is_nan, overloaded on C; the WGSL kernel's
// IS_FLOAT is not needed here).

//!interface

extern "C" __global__ void embedding(BG_ARGS) {
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

//!format

enum BlockKind : unsigned { Q4_1 = 0u, Q8_0 = 1u, FORMAT = 2u };  // FORMAT: the rendered block format

// A quantized-table embedding: ids outside [0, rows) give zeros.
template <unsigned KIND>
__device__ void embed_quantized(const int* ids, O* out, const Params& p, const unsigned* qtable) {
    unsigned i = bg_thread_index();
    if (i >= p.count * p.width) return;
    int id = ids[i / p.width];
    float value = 0.0f;
    if (id >= 0 && (unsigned)id < p.rows) {
        unsigned c = i % p.width;
        if (KIND == FORMAT) {
            value = block_value(load_block(qtable, p.width / 32u, (unsigned)id, c / 32u), c % 32u);
        } else {
            value = KIND == Q8_0 ? q8_0_weight(qtable, p, (unsigned)id, c) : q4_1_weight(qtable, p, (unsigned)id, c);
        }
    }
    out[i] = CVT(O, value);
}

extern "C" __global__ void embedding_q4_1(BG_ARGS) {
    embed_quantized<Q4_1>(ids, out, p, qtable);
}

extern "C" __global__ void embedding_q8_0(BG_ARGS) {
    embed_quantized<Q8_0>(ids, out, p, qtable);
}

extern "C" __global__ void embedding_blocks(BG_ARGS) {
    embed_quantized<FORMAT>(ids, out, p, qtable);
}

__device__ __forceinline__ unsigned argmax_chunks(const Params& p) { return (p.width - 1u) / p.chunk + 1u; }

// Block `item` takes piece item % chunks of row item / chunks and writes the row index of the piece's best
// element to indices[item] (rows taken whole: chunks = 1, item = row).
extern "C" __global__ void argmax_rows(BG_ARGS) {
    __shared__ C best_value[WG];
    __shared__ unsigned best_index[WG];
    unsigned lid = threadIdx.x;
    unsigned item = bg_block_index();
    unsigned chunks = argmax_chunks(p);
    unsigned clamped = bg_min(item, p.count * chunks - 1u);
    unsigned first = (clamped % chunks) * p.chunk;
    unsigned count = bg_min(p.chunk, p.width - first);
    unsigned base = (clamped / chunks) * p.width + first;
    C value = CVT(C, table[base]);
    unsigned index = 0;
    for (unsigned k = lid; k < count; k += WG) {
        C v = CVT(C, table[base + k]);
        if (bg_better(v, k, value, index)) {
            value = v;
            index = k;
        }
    }
    unsigned best = bg_tree_best(best_value, best_index, lid, value, index);
    if (lid == 0 && item < p.count * chunks) indices[item] = (int)(first + best);
}

// Long rows, second pass: one block per row reads its pieces' candidate indices (ids, as argmax_rows wrote
// them) and writes the best one to indices[row].
extern "C" __global__ void argmax_candidates(BG_ARGS) {
    __shared__ C best_value[WG];
    __shared__ unsigned best_index[WG];
    unsigned lid = threadIdx.x;
    unsigned row = bg_block_index();
    unsigned clamped = bg_min(row, p.count - 1u);
    unsigned chunks = argmax_chunks(p);
    unsigned first = clamped * chunks;
    unsigned base = clamped * p.width;
    unsigned index = (unsigned)ids[first];
    C value = CVT(C, table[base + index]);
    for (unsigned j = lid; j < chunks; j += WG) {
        unsigned k = (unsigned)ids[first + j];
        C v = CVT(C, table[base + k]);
        if (bg_better(v, k, value, index)) {
            value = v;
            index = k;
        }
    }
    unsigned best = bg_tree_best(best_value, best_index, lid, value, index);
    if (lid == 0 && row < p.count) indices[row] = (int)best;
}
