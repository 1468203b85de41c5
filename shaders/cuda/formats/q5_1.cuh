// Q5_1; mirrors shaders/wgsl/formats/q5_1.wgsl: [d | m], qh, 16 bytes of nibbles; w = d q + m.
__device__ __forceinline__ QBlock load_block(const unsigned* words, unsigned row_blocks, unsigned n, unsigned b) {
    unsigned at = block_at<6u, 1u>(row_blocks, n, b);
    QBlock qb = {};
    unsigned h = words[at + 1u];
#pragma unroll
    for (unsigned k = 0; k < 4u; k++) {
        byte_fields(qb, k, words[at + 2u + k], 0u, 15u);
        byte_fields(qb, k + 4u, words[at + 2u + k], 4u, 15u);
    }
#pragma unroll
    for (unsigned j = 0; j < 32u; j++) qb.q[j] += 16.0f * (float)((h >> j) & 1u);
    uniform_scale(qb, bg_bits2f(words[at] & 0xFFFFu), bg_bits2f(words[at] >> 16u));
    return qb;
}
