// F16; mirrors shaders/wgsl/formats/f16.wgsl: 32 float16 weights; w = q.
__device__ __forceinline__ QBlock load_block(const unsigned* words, unsigned row_blocks, unsigned n, unsigned b) {
    unsigned at = block_at<16u, 1u>(row_blocks, n, b);
    QBlock qb;
#pragma unroll
    for (unsigned j = 0; j < 32u; j++) qb.q[j] = bg_bits2f((words[at + j / 2u] >> (16u * (j % 2u))) & 0xFFFFu);
    uniform_scale(qb, 1.0f, 0.0f);
    return qb;
}
