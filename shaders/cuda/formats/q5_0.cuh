// Q5_0; mirrors shaders/wgsl/formats/q5_0.wgsl: [d | pad], qh, 16 bytes of nibbles; w = d (q - 16).
__device__ __forceinline__ QBlock load_block(const unsigned* words, unsigned row_blocks, unsigned n, unsigned b) {
    unsigned at = block_at<6u, 1u>(row_blocks, n, b);
    QBlock qb = {};
    nibble_block(qb, words, at + 2u, words[at + 1u]);
    float d = bg_bits2f(words[at] & 0xFFFFu);
    uniform_scale(qb, d, -16.0f * d);
    return qb;
}
