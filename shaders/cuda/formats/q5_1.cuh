// Q5_1; mirrors shaders/wgsl/formats/q5_1.wgsl: [d | m], qh, 16 bytes of nibbles; w = d q + m.
__device__ __forceinline__ QBlock load_block(const unsigned* words, unsigned row_blocks, unsigned n, unsigned b) {
    unsigned at = block_at<6u, 1u>(row_blocks, n, b);
    QBlock qb = {};
    nibble_block(qb, words, at + 2u, words[at + 1u]);
    uniform_scale(qb, bg_bits2f(words[at] & 0xFFFFu), bg_bits2f(words[at] >> 16u));
    return qb;
}
