// Q4_0; mirrors shaders/wgsl/formats/q4_0.wgsl: [d | pad], 16 bytes of nibbles; w = d (q - 8).
__device__ __forceinline__ QBlock load_block(const unsigned* words, unsigned row_blocks, unsigned n, unsigned b) {
    unsigned at = block_at<5u, 1u>(row_blocks, n, b);
    QBlock qb = {};
    nibble_block(qb, words, at + 1u, 0u);
    float d = bg_bits2f(words[at] & 0xFFFFu);
    uniform_scale(qb, d, -8.0f * d);
    return qb;
}
