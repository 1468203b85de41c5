// Q5_K; mirrors shaders/wgsl/formats/q5_k.wgsl: as Q4_K with 32 bytes of fifth bits (bit s of byte j:
// sub-block s, weight j) before the nibbles; w = d sc q - dmin m.
__device__ __forceinline__ QBlock load_block(const unsigned* words, unsigned row_blocks, unsigned n, unsigned b) {
    unsigned at = block_at<44u, 8u>(row_blocks, n, b);
    QBlock qb = {};
    unsigned s = b % 8u, base = at + 12u + 8u * (s / 2u), shift = 4u * (s % 2u);
#pragma unroll
    for (unsigned k = 0; k < 8u; k++) {
        byte_fields(qb, k, words[base + k], shift, 15u);
        byte_fields(qb, k, words[at + 4u + k], s, 1u, 16.0f);
    }
    float scale, low;
    k_scale_min(words, at + 1u, s, scale, low);
    uniform_scale(qb, bg_bits2f(words[at] & 0xFFFFu) * scale, -bg_bits2f(words[at] >> 16u) * low);
    return qb;
}
