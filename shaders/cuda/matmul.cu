// Tiled matmul out[z] = A[z] (M x K) @ B[z] (K x N); mirrors shaders/wgsl/matmul.wgsl. A 16x16 block
// computes a 64x64 output tile, k advancing 16 at a time through tiles in shared memory; each thread
// keeps 4x4 accumulators. Operands are read through element strides. A (operand type), O (output),
// C (accumulator type), HAS_BIAS.

#ifndef HAS_BIAS
#define HAS_BIAS 0
#endif
#define TILE 64u
#define TK 16u

struct Params {
    unsigned m, n, k, batch_ndim;
    unsigned strides[4];  // a_sm, a_sk, b_sk, b_sn
    unsigned pad[4];
    unsigned batch_shape[8];
    unsigned a_batch_strides[8];
    unsigned b_batch_strides[8];
};

__device__ __forceinline__ C load_a(const A* a, const Params& p, unsigned base, unsigned row, unsigned k) {
    return (row < p.m && k < p.k) ? CVT(C, a[base + row * p.strides[0] + k * p.strides[1]]) : (C)0;
}

__device__ __forceinline__ C load_b(const A* b, const Params& p, unsigned base, unsigned k, unsigned col) {
    return (k < p.k && col < p.n) ? CVT(C, b[base + k * p.strides[2] + col * p.strides[3]]) : (C)0;
}

__device__ __forceinline__ void store_row(O* out, const A* bias, const Params& p, unsigned base, unsigned row,
                                          unsigned col, const C* values) {
    if (row >= p.m) return;
    for (unsigned j = 0; j < 4; j++) {
        if (col + j < p.n) {
            C value = values[j];
            if (HAS_BIAS) value += CVT(C, bias[col + j]);
            out[base + row * p.n + col + j] = CVT(O, value);
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) matmul(const A* a, const A* b, O* out, const Params p, const A* bias) {
    __shared__ C a_tile[TK][TILE];  // 4 consecutive rows at one k per staging thread
    __shared__ C b_tile[TK][TILE];  // 4 consecutive columns at one k per staging thread
    unsigned tx = threadIdx.x, ty = threadIdx.y;
    unsigned rem = blockIdx.z, a_base = 0, b_base = 0;
    for (unsigned d = p.batch_ndim; d > 0;) {
        d--;
        unsigned extent = p.batch_shape[d];
        unsigned index = rem % extent;
        rem /= extent;
        a_base += index * p.a_batch_strides[d];
        b_base += index * p.b_batch_strides[d];
    }
    unsigned row0 = blockIdx.y * TILE, col0 = blockIdx.x * TILE;
    unsigned stage_row = row0 + tx * 4u, stage_col = col0 + tx * 4u;
    C acc[4][4];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = (C)0;
    for (unsigned k0 = 0; k0 < p.k; k0 += TK) {
        unsigned k = k0 + ty;
        for (unsigned j = 0; j < 4; j++) {
            a_tile[ty][tx * 4 + j] = load_a(a, p, a_base, stage_row + j, k);
            b_tile[ty][tx * 4 + j] = load_b(b, p, b_base, k, stage_col + j);
        }
        __syncthreads();
#pragma unroll
        for (unsigned kk = 0; kk < TK; kk++) {
            C av[4], bv[4];
            for (int j = 0; j < 4; j++) {
                av[j] = a_tile[kk][ty * 4 + j];
                bv[j] = b_tile[kk][tx * 4 + j];
            }
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 4; j++) acc[i][j] += av[i] * bv[j];
        }
        __syncthreads();
    }
    unsigned out_base = blockIdx.z * p.m * p.n;
    unsigned row = row0 + ty * 4u, col = col0 + tx * 4u;
    for (unsigned i = 0; i < 4; i++) store_row(out, bias, p, out_base, row + i, col, acc[i]);
}

// Few rows of A (decode-style GEMV): one thread per output (column, row); block y picks the row.
// Each thread: 8 consecutive output columns of one row of A (block y), as batchgpu/ops/matmul.py launches.
extern "C" __global__ void matmul_skinny(const A* a, const A* b, O* out, const Params p, const A* bias) {
    unsigned col0 = (blockIdx.x * blockDim.x + threadIdx.x) * 8u;
    if (col0 >= p.n) return;
    unsigned row = blockIdx.y;
    C acc[8] = {};
    for (unsigned k = 0; k < p.k; k++) {
        C av = CVT(C, a[row * p.strides[0] + k * p.strides[1]]);
#pragma unroll
        for (unsigned j = 0; j < 8u; j++) {
            if (col0 + j < p.n) acc[j] += av * CVT(C, b[k * p.strides[2] + (col0 + j) * p.strides[3]]);
        }
    }
#pragma unroll
    for (unsigned j = 0; j < 8u; j++) {
        if (col0 + j >= p.n) continue;
        C value = acc[j];
        if (HAS_BIAS) value += CVT(C, bias[col0 + j]);
        out[row * p.n + col0 + j] = CVT(O, value);
    }
}

// Few rows of A times a B stored (N, K) (transpose_b: b_sk == 1), decode-style: one 32-lane warp per
// output column n (the linear block index times the warps per block, plus the warp), lanes striding over k so a warp reads a row of B coalesced; the
// p.m <= 8 rows of A share each B load. The native executors launch it (batchgpu/ops/matmul.py).
extern "C" __global__ void matmul_gemv_t(const A* a, const A* b, O* out, const Params p, const A* bias) {
    unsigned lane = threadIdx.x & 31u;
    unsigned n = bg_block_index() * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const A* b_row = b + bg_min(n, p.n - 1u) * p.strides[3];
    C acc[8] = {};
    for (unsigned k = lane; k < p.k; k += 32u) {
        C bv = CVT(C, b_row[k]);
#pragma unroll
        for (unsigned r = 0; r < 8u; r++) {
            if (r < p.m) acc[r] += CVT(C, a[r * p.strides[0] + k * p.strides[1]]) * bv;
        }
    }
#pragma unroll
    for (unsigned r = 0; r < 8u; r++) {
        if (r >= p.m) break;  // p.m is uniform: every lane takes the same sums
        C value = bg_warp_sum(acc[r]);
        if (lane != 0u || n >= p.n) continue;
        if (HAS_BIAS) value += CVT(C, bias[n]);
        out[r * p.n + n] = CVT(O, value);
    }
}
