// Matmul with GGUF block-quantized weights: out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]).
// matmul_q4_1 / matmul_q8_0 mirror shaders/wgsl/qmatmul.wgsl: each thread computes ROWS (8)
// consecutive output features n for XROWS (4) rows m0.. of x (block y; the last group may have fewer),
// loading each block of x once for all 8 and applying each weight block to the rows.
// The native executors launch the *_warp entries instead (batchgpu/ops/matmul.py): one 32-lane warp
// per output feature n, lanes striding over the row's words so a warp reads W coalesced, then a warp
// sum. x is read as float4 (float32 activations, K a multiple of 32). Split-K as in the WGSL twin: split s
// of p.splits takes blocks [s * block_chunk, min(blocks, (s + 1) * block_chunk)) into slice s of a
// (splits, m, n) output, split 0 adding the bias. A (bias type), O (output), HAS_BIAS.

//!interface

#ifndef ACTIVATION_EXPR
#define ACTIVATION_EXPR x
#endif

// matmul(..., activation=op): the op's expression (x without one), applied in the store after the bias;
// the lowering sets it on launches of one split only.
__device__ __forceinline__ C activation(C x) { return ACTIVATION_EXPR; }

// First and end block of split `split` (an empty range for a split past the end); mirrors split_blocks.
__device__ __forceinline__ unsigned split_first(const Params& p, unsigned split) { return split * p.block_chunk; }
__device__ __forceinline__ unsigned split_end(const Params& p, unsigned split) {
    return bg_min(p.blocks, split_first(p, split) + p.block_chunk);
}

// Output (m, n) of split `split`: element (split, m, n) of the (splits, m, n) output.
__device__ __forceinline__ void store(O* out, const A* bias, const Params& p, unsigned split, unsigned n, unsigned m,
                                      float value) {
    float extra = HAS_BIAS && split == 0u ? CVT(float, bias[n]) : 0.0f;
    out[(split * p.m + m) * p.n + n] = CVT(O, activation(value + extra));
}

// The SWIGLU epilogue (one split only): output (m, n / 2) of the pair of rows n (gate), n + 1 (up).
__device__ __forceinline__ void store_pair(O* out, const Params& p, unsigned n, unsigned m, float gate, float up) {
    if (n >= p.n) return;
    out[m * (p.n / 2u) + n / 2u] = CVT(O, gate / (1.0f + expf(-gate)) * up);
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

//!format

enum BlockKind : unsigned { Q4_1 = 0u, Q8_0 = 1u, FORMAT = 2u };  // FORMAT: the rendered block format

// Block b of row n in the rendered block format dotted with xb (xhalf: the sum of its first 16 values,
// xsum: of all): d0 * sum(q x) + m0 * sum(x) over each half.
__device__ __forceinline__ float format_dot(const QBlock& qb, const float4* xb, float xhalf, float xsum) {
    float first = 0.0f, second = 0.0f;
#pragma unroll
    for (unsigned i = 0; i < 4u; i++) {
        first += dot4(qb.q[4u * i], qb.q[4u * i + 1u], qb.q[4u * i + 2u], qb.q[4u * i + 3u], xb[i]);
        second += dot4(qb.q[16u + 4u * i], qb.q[17u + 4u * i], qb.q[18u + 4u * i], qb.q[19u + 4u * i], xb[4u + i]);
    }
    return qb.d0 * first + qb.m0 * xhalf + qb.d1 * second + qb.m1 * (xsum - xhalf);
}

__device__ __forceinline__ float format_block(const unsigned* w, const Params& p, unsigned n, unsigned b,
                                              const float4* xb, float xhalf, float xsum) {
    return format_dot(load_block(w, p.blocks, n, b), xb, xhalf, xsum);
}

// Block b of x's row m as format_dot takes it: its 8 float4s, the sums of its first 16 and all values.
__device__ __forceinline__ void load_x_block(const float4* x, const Params& p, unsigned m, unsigned b, float4* xb,
                                             float& xhalf, float& xsum) {
    xhalf = xsum = 0.0f;
#pragma unroll
    for (unsigned i = 0; i < 8u; i++) {
        xb[i] = x[m * (p.k / 4u) + b * 8u + i];
        xsum += xb[i].x + xb[i].y + xb[i].z + xb[i].w;
        if (i == 3u) xhalf = xsum;
    }
}

// Block b of row n of W dotted with the block xb of x (xhalf, xsum: sums of its first 16 and all values):
// d * sum(q * x) (+ m * sum(x)).
template <unsigned KIND>
__device__ __forceinline__ float block_dot(const unsigned* w, const Params& p, unsigned n, unsigned b,
                                           const float4* xb, float xhalf, float xsum) {
    if (KIND == FORMAT) return format_block(w, p, n, b, xb, xhalf, xsum);
    if (KIND == Q8_0) {
        unsigned at = (n * p.blocks + b) * 9u;
        float qx = 0.0f;
#pragma unroll
        for (unsigned i = 0; i < 8u; i++) qx += dot_i8(w[at + 1u + i], xb[i]);
        return bg_bits2f(w[at] & 0xFFFFu) * qx;
    }
    unsigned at = (n * p.blocks + b) * 5u;
    float qx = 0.0f;
#pragma unroll
    for (unsigned i = 0; i < 4u; i++) {
        unsigned word = w[at + 1u + i];
        qx += dot_u8(word & 0x0F0F0F0Fu, xb[i]) + dot_u8((word >> 4u) & 0x0F0F0F0Fu, xb[4u + i]);
    }
    unsigned scales = w[at];
    return bg_bits2f(scales & 0xFFFFu) * qx + bg_bits2f(scales >> 16u) * xsum;
}

template <unsigned KIND>
__device__ void matmul_rows(const float4* x, const unsigned* w, O* out, const Params& p, const A* bias) {
    unsigned n0 = (blockIdx.x * blockDim.x + threadIdx.x) * ROWS;
    if (n0 >= p.n) return;
    unsigned m0 = blockIdx.y * XROWS, split = blockIdx.z;
    unsigned rows = bg_min(XROWS, p.m - m0);  // the last group may have fewer
    float acc[XROWS][ROWS] = {};
    for (unsigned b = split_first(p, split), end = split_end(p, split); b < end; b++) {
        float4 xb[XROWS][8];
        float xhalf[XROWS], xsum[XROWS];
#pragma unroll
        for (unsigned j = 0; j < XROWS; j++) {
            if (j >= rows) break;
            load_x_block(x, p, m0 + j, b, xb[j], xhalf[j], xsum[j]);
        }
#pragma unroll
        for (unsigned r = 0; r < ROWS; r++) {
            if (n0 + r >= p.n) break;
#pragma unroll
            for (unsigned j = 0; j < XROWS; j++) {
                if (j < rows) acc[j][r] += block_dot<KIND>(w, p, n0 + r, b, xb[j], xhalf[j], xsum[j]);
            }
        }
    }
#pragma unroll
    for (unsigned j = 0; j < XROWS; j++) {
        if (j >= rows) break;
        if (SWIGLU) {
#pragma unroll
            for (unsigned r = 0; r < ROWS; r += 2u) store_pair(out, p, n0 + r, m0 + j, acc[j][r], acc[j][r + 1u]);
            continue;
        }
#pragma unroll
        for (unsigned r = 0; r < ROWS; r++) {
            if (n0 + r < p.n) store(out, bias, p, split, n0 + r, m0 + j, acc[j][r]);
        }
    }
}

extern "C" __global__ void matmul_q4_1(BG_ARGS) {
    matmul_rows<Q4_1>(x, w, out, p, bias);
}

extern "C" __global__ void matmul_q8_0(BG_ARGS) {
    matmul_rows<Q8_0>(x, w, out, p, bias);
}

extern "C" __global__ void matmul_blocks(BG_ARGS) {
    matmul_rows<FORMAT>(x, w, out, p, bias);
}

// One warp per output feature n of XROWS (4) rows m0.. of x (the last group may have fewer) and split,
// each weight word read once for the rows: the linear block index (split over grid x/y by the executor)
// runs over ceil(p.n / warps per block) blocks per group of rows, group after group, split after split. A
// unit is one data word of a block with the float4s of x it multiplies: Q4_1 has 4 per block (low
// nibbles: x[4i..4i+3], high nibbles: x[16+4i..]), Q8_0 has 8, the rendered FORMAT one (a whole block).
// Every lane runs the warp sums (lanes past p.n read the last row).
template <unsigned KIND>
__device__ void matmul_warp_rows(const float4* x, const unsigned* w, O* out, const Params& p, const A* bias) {
    unsigned lane = threadIdx.x & 31u, warps = blockDim.x >> 5;
    unsigned per_row = (p.n + warps - 1u) / warps, block = bg_block_index();
    unsigned row_groups = (p.m + XROWS - 1u) / XROWS;
    unsigned split = block / per_row / row_groups;
    if (split >= p.splits) return;  // spare blocks of a count spread over grid x and y
    unsigned m0 = block / per_row % row_groups * XROWS, n = (block % per_row) * warps + (threadIdx.x >> 5);
    unsigned rows = bg_min(XROWS, p.m - m0);
    unsigned row = bg_min(n, p.n - 1u);
    const unsigned units = KIND == Q8_0 ? 8u : KIND == Q4_1 ? 4u : 1u;  // per block
    const unsigned end = split_end(p, split) * units;
    float acc[XROWS] = {};
    for (unsigned u = split_first(p, split) * units + lane; u < end; u += 32u) {
        if (KIND == FORMAT) {
            QBlock qb = load_block(w, p.blocks, row, u);
#pragma unroll
            for (unsigned j = 0; j < XROWS; j++) {
                if (j >= rows) break;
                float4 xb[8];
                float xhalf, xsum;
                load_x_block(x, p, m0 + j, u, xb, xhalf, xsum);
                acc[j] += format_dot(qb, xb, xhalf, xsum);
            }
        } else if (KIND == Q8_0) {
            unsigned b = u >> 3, i = u & 7u, at = (row * p.blocks + b) * 9u;
            float d = bg_bits2f(w[at] & 0xFFFFu);
            unsigned word = w[at + 1u + i];
#pragma unroll
            for (unsigned j = 0; j < XROWS; j++) {
                if (j >= rows) break;
                acc[j] += d * dot_i8(word, x[(m0 + j) * (p.k / 4u) + b * 8u + i]);
            }
        } else {
            unsigned b = u >> 2, i = u & 3u, at = (row * p.blocks + b) * 5u;
            unsigned scales = w[at], word = w[at + 1u + i];
#pragma unroll
            for (unsigned j = 0; j < XROWS; j++) {
                if (j >= rows) break;
                const float4* xm = x + (m0 + j) * (p.k / 4u);
                float4 lo = xm[b * 8u + i], hi = xm[b * 8u + 4u + i];
                float qx = dot_u8(word & 0x0F0F0F0Fu, lo) + dot_u8((word >> 4u) & 0x0F0F0F0Fu, hi);
                float xs = (lo.x + lo.y) + (lo.z + lo.w) + (hi.x + hi.y) + (hi.z + hi.w);
                acc[j] += bg_bits2f(scales & 0xFFFFu) * qx + bg_bits2f(scales >> 16u) * xs;
            }
        }
    }
    __shared__ float totals[32];
#pragma unroll
    for (unsigned j = 0; j < XROWS; j++) {
        if (j >= rows) break;
        float total = bg_warp_sum(acc[j]);
        if (SWIGLU) {  // warps 2j and 2j + 1 hold the gate and up rows of a pair
            __syncthreads();  // the previous row's readers are done with totals
            if (lane == 0u) totals[threadIdx.x >> 5] = total;
            __syncthreads();
            if (lane == 0u && ((threadIdx.x >> 5) & 1u) == 0u)
                store_pair(out, p, n, m0 + j, total, totals[(threadIdx.x >> 5) + 1u]);
        } else if (lane == 0u && n < p.n) {
            store(out, bias, p, split, n, m0 + j, total);
        }
    }
}

extern "C" __global__ void matmul_q4_1_warp(BG_ARGS) {
    matmul_warp_rows<Q4_1>(x, w, out, p, bias);
}

extern "C" __global__ void matmul_q8_0_warp(BG_ARGS) {
    matmul_warp_rows<Q8_0>(x, w, out, p, bias);
}

extern "C" __global__ void matmul_blocks_warp(BG_ARGS) {
    matmul_warp_rows<FORMAT>(x, w, out, p, bias);
}
