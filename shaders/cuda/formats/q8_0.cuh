// Q8_0; mirrors shaders/wgsl/formats/q8_0.wgsl: [d | pad], 32 int8; w = d q.
__device__ __forceinline__ QBlock load_block(const unsigned* words, unsigned row_blocks, unsigned n, unsigned b) {
    unsigned at = block_at<9u, 1u>(row_blocks, n, b);
    QBlock qb;
#pragma unroll
    for (unsigned j = 0; j < 32u; j++) qb.q[j] = (float)(signed char)qbyte(words, at + 1u, j);
    uniform_scale(qb, bg_bits2f(words[at] & 0xFFFFu), 0.0f);
    return qb;
}
