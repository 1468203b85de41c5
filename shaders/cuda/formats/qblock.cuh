// A 32-weight block of quantized weights dequantized in registers; mirrors shaders/wgsl/lib/qblock.wgsl
// (batchgpu/quant.py has the formats; the format's load_block follows from shaders/cuda/formats/). q[j] is
// weight j's raw quant value: weight j is d0 * q + m0 for j < 16, d1 * q + m1 after.
struct QBlock {
    float q[32];
    float d0, m0, d1, m1;
};

// The first word of the format block (WORDS words, BLOCKS kernel blocks of 32 weights) holding kernel block
// b of row n of row_blocks blocks.
template <unsigned WORDS, unsigned BLOCKS>
__device__ __forceinline__ unsigned block_at(unsigned row_blocks, unsigned n, unsigned b) {
    return (n * (row_blocks / BLOCKS) + b / BLOCKS) * WORDS;
}

// Byte `byte` counted from word `at`.
__device__ __forceinline__ unsigned qbyte(const unsigned* words, unsigned at, unsigned byte) {
    return (words[at + byte / 4u] >> (8u * (byte % 4u))) & 0xFFu;
}

// Adds to weights 4k..4k+3 the `mask` bits at bit `at` of each byte of word, times `scale`.
__device__ __forceinline__ void byte_fields(QBlock& qb, unsigned k, unsigned word, unsigned at, unsigned mask,
                                            float scale = 1.0f) {
#pragma unroll
    for (unsigned i = 0; i < 4u; i++) qb.q[4u * k + i] += scale * (float)((word >> (at + 8u * i)) & mask);
}

// Q4_K / Q5_K: the 6-bit scale and min of sub-block s from the 12 bytes at word `at`.
__device__ __forceinline__ void k_scale_min(const unsigned* words, unsigned at, unsigned s, float& scale, float& low) {
    if (s < 4u) {
        scale = (float)(qbyte(words, at, s) & 63u);
        low = (float)(qbyte(words, at, s + 4u) & 63u);
        return;
    }
    scale = (float)((qbyte(words, at, s + 4u) & 0x0Fu) | ((qbyte(words, at, s - 4u) >> 6u) << 4u));
    low = (float)((qbyte(words, at, s + 4u) >> 4u) | ((qbyte(words, at, s) >> 6u) << 4u));
}

__device__ __forceinline__ void uniform_scale(QBlock& qb, float d, float m) {
    qb.d0 = qb.d1 = d;
    qb.m0 = qb.m1 = m;
}

// Weight j of a block.
__device__ __forceinline__ float block_value(const QBlock& qb, unsigned j) {
    return j < 16u ? qb.d0 * qb.q[j] + qb.m0 : qb.d1 * qb.q[j] + qb.m1;
}

// The 32 nibbles of the 16 bytes at word `at` (byte j: weight j low, j + 16 high), plus 16 times the
// fifth bits `h` (bit j: weight j; 0 for 4-bit formats).
__device__ __forceinline__ void nibble_block(QBlock& qb, const unsigned* words, unsigned at, unsigned h) {
#pragma unroll
    for (unsigned k = 0; k < 4u; k++) {
        byte_fields(qb, k, words[at + k], 0u, 15u);
        byte_fields(qb, k + 4u, words[at + k], 4u, 15u);
    }
#pragma unroll
    for (unsigned j = 0; j < 32u; j++) qb.q[j] += 16.0f * (float)((h >> j) & 1u);
}

// A K-quant sub-block: weights 4k..4k+3 take the 4 bits at `shift` of the bytes of word low + k, plus 16
// times the `mask` bits at `bit` of the bytes of word high + k (mask 0: none).
__device__ __forceinline__ void k_block(QBlock& qb, const unsigned* words, unsigned low, unsigned shift, unsigned high,
                                        unsigned bit, unsigned mask) {
#pragma unroll
    for (unsigned k = 0; k < 8u; k++) {
        byte_fields(qb, k, words[low + k], shift, 15u);
        byte_fields(qb, k, words[high + k], bit, mask, 16.0f);
    }
}
