// Matmul with GGUF block-quantized weights: out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]); mirrors
// shaders/wgsl/qmatmul.wgsl. One thread per output (n, m); block y picks the row of x. x is read as
// float4 (float32 activations, K a multiple of 32). A (bias type), O (output), HAS_BIAS.

#ifndef HAS_BIAS
#define HAS_BIAS 0
#endif

struct Params {
    unsigned m, n, k;
    unsigned blocks;  // blocks per row = k / 32
};

__device__ __forceinline__ void store(O* out, const A* bias, const Params& p, unsigned n, unsigned m, float value) {
    float extra = HAS_BIAS ? CVT(float, bias[n]) : 0.0f;
    out[m * p.n + n] = CVT(O, value + extra);
}

__device__ __forceinline__ float dot4(float a0, float a1, float a2, float a3, float4 b) {
    return a0 * b.x + a1 * b.y + a2 * b.z + a3 * b.w;
}

// unpack4xU8 / unpack4xI8 of WGSL, dotted with a float4.
__device__ __forceinline__ float dot_u8(unsigned word, float4 b) {
    return dot4((float)(word & 0xFFu), (float)((word >> 8) & 0xFFu), (float)((word >> 16) & 0xFFu),
                (float)(word >> 24), b);
}
__device__ __forceinline__ float dot_i8(unsigned word, float4 b) {
    return dot4((float)(signed char)(word & 0xFFu), (float)(signed char)((word >> 8) & 0xFFu),
                (float)(signed char)((word >> 16) & 0xFFu), (float)(signed char)(word >> 24), b);
}

extern "C" __global__ void matmul_q4_1(const float4* x, const unsigned* w, O* out, const Params p, const A* bias) {
    unsigned n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= p.n) return;
    unsigned m = blockIdx.y;
    unsigned x_row = m * (p.k / 4u);
    float acc = 0.0f;
    for (unsigned b = 0; b < p.blocks; b++) {
        unsigned at = (n * p.blocks + b) * 5u;
        unsigned xb = x_row + b * 8u;
        float qx = 0.0f, sx = 0.0f;
        for (unsigned i = 0; i < 4u; i++) {
            unsigned word = w[at + 1u + i];
            float4 low = x[xb + i];
            float4 high = x[xb + 4u + i];
            qx += dot_u8(word & 0x0F0F0F0Fu, low);
            qx += dot_u8((word >> 4u) & 0x0F0F0F0Fu, high);
            sx += (low.x + high.x) + (low.y + high.y) + (low.z + high.z) + (low.w + high.w);
        }
        unsigned scales = w[at];
        acc += bg_bits2f(scales & 0xFFFFu) * qx + bg_bits2f(scales >> 16u) * sx;
    }
    store(out, bias, p, n, m, acc);
}

extern "C" __global__ void matmul_q8_0(const float4* x, const unsigned* w, O* out, const Params p, const A* bias) {
    unsigned n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= p.n) return;
    unsigned m = blockIdx.y;
    unsigned x_row = m * (p.k / 4u);
    float acc = 0.0f;
    for (unsigned b = 0; b < p.blocks; b++) {
        unsigned at = (n * p.blocks + b) * 9u;
        unsigned xb = x_row + b * 8u;
        float qx = 0.0f;
        for (unsigned i = 0; i < 8u; i++) qx += dot_i8(w[at + 1u + i], x[xb + i]);
        acc += bg_bits2f(w[at] & 0xFFFFu) * qx;
    }
    store(out, bias, p, n, m, acc);
}
