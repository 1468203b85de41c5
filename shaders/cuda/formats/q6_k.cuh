// Q6_K; mirrors shaders/wgsl/formats/q6_k.wgsl: 256 weights, 128 bytes of low nibbles, 64 of high 2-bit
// pairs, 16 int8 scales (one per 16 weights), [d | pad]; sub-block s = 4h + i; w = d sc (q - 32).
__device__ __forceinline__ QBlock load_block(const unsigned* words, unsigned row_blocks, unsigned n, unsigned b) {
    unsigned at = block_at<53u, 8u>(row_blocks, n, b);
    QBlock qb = {};
    unsigned s = b % 8u, h = s / 4u, i = s % 4u;
    k_block(qb, words, at + 16u * h + 8u * (i % 2u), 4u * (i / 2u), at + 32u + 8u * h, 2u * i, 3u);
    float d = bg_bits2f(words[at + 52u] & 0xFFFFu);
    qb.d0 = d * (float)(signed char)qbyte(words, at + 48u, 2u * s);
    qb.d1 = d * (float)(signed char)qbyte(words, at + 48u, 2u * s + 1u);
    qb.m0 = -32.0f * qb.d0;
    qb.m1 = -32.0f * qb.d1;
    return qb;
}
