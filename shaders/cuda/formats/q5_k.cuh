// Q5_K; mirrors shaders/wgsl/formats/q5_k.wgsl: as Q4_K with 32 bytes of fifth bits (bit s of byte j:
// sub-block s, weight j) before the nibbles; w = d sc q - dmin m.
__device__ __forceinline__ QBlock load_block(const unsigned* words, unsigned row_blocks, unsigned n, unsigned b) {
    unsigned at = block_at<44u, 8u>(row_blocks, n, b);
    QBlock qb = {};
    unsigned s = b % 8u;
    k_block(qb, words, at + 12u + 8u * (s / 2u), 4u * (s % 2u), at + 4u, s, 1u);
    float scale, low;
    k_scale_min(words, at + 1u, s, scale, low);
    uniform_scale(qb, bg_bits2f(words[at] & 0xFFFFu) * scale, -bg_bits2f(words[at] >> 16u) * low);
    return qb;
}
