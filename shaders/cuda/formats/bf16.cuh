// BF16; mirrors shaders/wgsl/formats/bf16.wgsl: 32 bfloat16 weights (top halves of float32s); w = q.
__device__ __forceinline__ QBlock load_block(const unsigned* words, unsigned row_blocks, unsigned n, unsigned b) {
    unsigned at = block_at<16u, 1u>(row_blocks, n, b);
    QBlock qb;
#pragma unroll
    for (unsigned j = 0; j < 32u; j++) {
        unsigned word = words[at + j / 2u];
        qb.q[j] = __uint_as_float(j % 2u ? word & 0xFFFF0000u : word << 16u);
    }
    uniform_scale(qb, 1.0f, 0.0f);
    return qb;
}
