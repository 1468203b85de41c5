// Q4_K; mirrors shaders/wgsl/formats/q4_k.wgsl: 256 weights, [d | dmin], 12 bytes of 6-bit scales and
// mins, 128 bytes of nibbles (sub-blocks 2i, 2i + 1: low and high nibbles of bytes 32i..); w = d sc q - dmin m.
__device__ __forceinline__ QBlock load_block(const unsigned* words, unsigned row_blocks, unsigned n, unsigned b) {
    unsigned at = block_at<36u, 8u>(row_blocks, n, b);
    QBlock qb = {};
    unsigned s = b % 8u;
    k_block(qb, words, at + 4u + 8u * (s / 2u), 4u * (s % 2u), at, 0u, 0u);
    float scale, low;
    k_scale_min(words, at + 1u, s, scale, low);
    uniform_scale(qb, bg_bits2f(words[at] & 0xFFFFu) * scale, -bg_bits2f(words[at] >> 16u) * low);
    return qb;
}
