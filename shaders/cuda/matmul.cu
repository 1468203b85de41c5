// Tiled matmul out[z] = A[z] (M x K) @ B[z] (K x N); mirrors shaders/wgsl/matmul.wgsl. A TILE_WG x TILE_WG
// (16x16) block computes a TILE x TILE (64x64) output tile, k advancing TK (16) at a time through tiles in
// shared memory; each thread keeps 4x4 accumulators. Operands are read through element strides. Split-K as
// in the WGSL twin: split s of p.split_k[1] accumulates k in [s * k_chunk, min(k, (s + 1) * k_chunk)) into
// slice s of a (batch, splits, m, n) output, split 0 adding the bias. A (operand type), O (output), C
// (accumulator type), HAS_BIAS.

//!interface

#ifndef ACTIVATION_EXPR
#define ACTIVATION_EXPR x
#endif

// matmul(..., activation=op): the op's expression (x without one), applied in the store after the bias;
// the lowering sets it on launches of one split only.
__device__ __forceinline__ C activation(C x) { return ACTIVATION_EXPR; }

// First and end k of split `split` (an empty range for a split past the end); mirrors split_range.
__device__ __forceinline__ unsigned split_first(const Params& p, unsigned split) { return split * p.split_k[0]; }
__device__ __forceinline__ unsigned split_end(const Params& p, unsigned split) {
    return bg_min(p.k, split_first(p, split) + p.split_k[0]);
}

__device__ __forceinline__ C load_a(const A* a, const Params& p, unsigned base, unsigned row, unsigned k) {
    return (row < p.m && k < p.k) ? CVT(C, a[base + row * p.strides[0] + k * p.strides[1]]) : (C)0;
}

__device__ __forceinline__ C load_b(const A* b, const Params& p, unsigned base, unsigned k, unsigned col) {
    return (k < p.k && col < p.n) ? CVT(C, b[base + k * p.strides[2] + col * p.strides[3]]) : (C)0;
}

__device__ __forceinline__ void store_row(O* out, const A* bias, const Params& p, unsigned base, unsigned row,
                                          unsigned col, const C* values, bool with_bias) {
    if (row >= p.m) return;
    for (unsigned j = 0; j < 4; j++) {
        if (col + j < p.n) {
            C value = values[j];
            if (HAS_BIAS && with_bias) value += CVT(C, bias[col + j]);
            out[base + row * p.n + col + j] = CVT(O, activation(value));
        }
    }
}

// Element offsets of the A and B matrices of batch entry blockIdx.z (broadcast batch strides).
__device__ __forceinline__ void batch_bases(const Params& p, unsigned& a_base, unsigned& b_base) {
    unsigned rem = blockIdx.z;
    a_base = 0;
    b_base = 0;
    for (unsigned d = p.batch_ndim; d > 0;) {
        d--;
        unsigned extent = p.batch_shape[d];
        unsigned index = rem % extent;
        rem /= extent;
        a_base += index * p.a_batch_strides[d];
        b_base += index * p.b_batch_strides[d];
    }
}

extern "C" __global__ void __launch_bounds__(TILE_WG * TILE_WG) matmul(BG_ARGS) {
    __shared__ C a_tile[TK][TILE];  // 4 consecutive rows at one k per staging thread
    __shared__ C b_tile[TK][TILE];  // 4 consecutive columns at one k per staging thread
    unsigned tx = threadIdx.x, ty = threadIdx.y;
    unsigned a_base, b_base;
    batch_bases(p, a_base, b_base);
    unsigned splits = p.split_k[1], split = blockIdx.y % splits;  // grid y runs over m tiles x splits
    unsigned row0 = (blockIdx.y / splits) * TILE, col0 = blockIdx.x * TILE;
    unsigned stage_row = row0 + tx * 4u, stage_col = col0 + tx * 4u;
    C acc[4][4];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = (C)0;
    unsigned k_end = split_end(p, split);  // k_chunk is a multiple of TK: no tile straddles two splits
    for (unsigned k0 = split_first(p, split); k0 < k_end; k0 += TK) {
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
    unsigned out_base = (blockIdx.z * splits + split) * p.m * p.n;
    unsigned row = row0 + ty * 4u, col = col0 + tx * 4u;
    for (unsigned i = 0; i < 4; i++) store_row(out, bias, p, out_base, row + i, col, acc[i], split == 0u);
}

// Few rows of A (decode-style GEMV); mirrors matmul_skinny of the WGSL twin. Each thread: SKINNY_COLUMNS
// consecutive output columns of one row of A (block y) and split (block z), as batchgpu/ops/matmul.py
// launches.
extern "C" __global__ void matmul_skinny(BG_ARGS) {
    unsigned col0 = (blockIdx.x * blockDim.x + threadIdx.x) * SKINNY_COLUMNS;
    if (col0 >= p.n) return;
    unsigned row = blockIdx.y, split = blockIdx.z;
    C acc[SKINNY_COLUMNS] = {};
    for (unsigned k = split_first(p, split), k_end = split_end(p, split); k < k_end; k++) {
        C av = CVT(C, a[row * p.strides[0] + k * p.strides[1]]);
#pragma unroll
        for (unsigned j = 0; j < SKINNY_COLUMNS; j++) {
            if (col0 + j < p.n) acc[j] += av * CVT(C, b[k * p.strides[2] + (col0 + j) * p.strides[3]]);
        }
    }
#pragma unroll
    for (unsigned j = 0; j < SKINNY_COLUMNS; j++) {
        if (col0 + j >= p.n) continue;
        C value = acc[j];
        if (HAS_BIAS && split == 0u) value += CVT(C, bias[col0 + j]);
        out[(split * p.m + row) * p.n + col0 + j] = CVT(O, activation(value));
    }
}

// Few rows of A times a B stored (N, K) (transpose_b: b_sk == 1), decode-style; mirrors matmul_gemv_t of
// the WGSL twin: one 32-lane warp per output column n of one split (the linear block index runs over
// ceil(p.n / warps per block) blocks per split, split after split), lanes striding over the split's k so a
// warp reads a row of B coalesced; the p.m <= SKINNY_ROWS rows of A share each B load. The native executors
// launch it (batchgpu/ops/matmul.py).
extern "C" __global__ void matmul_gemv_t(BG_ARGS) {
    unsigned lane = threadIdx.x & 31u, warps = blockDim.x >> 5;
    unsigned per_split = (p.n + warps - 1u) / warps, block = bg_block_index();
    unsigned split = block / per_split;
    if (split >= p.split_k[1]) return;  // spare blocks of a count spread over grid x and y
    unsigned n = (block % per_split) * warps + (threadIdx.x >> 5);
    const A* b_row = b + bg_min(n, p.n - 1u) * p.strides[3];
    C acc[SKINNY_ROWS] = {};
    unsigned k = split_first(p, split) + lane, k_end = split_end(p, split);
    for (; k + 96u < k_end; k += 128u) {  // four loads in flight per lane
        C bv[4];
#pragma unroll
        for (unsigned u = 0; u < 4u; u++) bv[u] = CVT(C, b_row[k + 32u * u]);
#pragma unroll
        for (unsigned r = 0; r < SKINNY_ROWS; r++) {
            if (r >= p.m) break;
#pragma unroll
            for (unsigned u = 0; u < 4u; u++) acc[r] += CVT(C, a[r * p.strides[0] + (k + 32u * u) * p.strides[1]]) * bv[u];
        }
    }
    for (; k < k_end; k += 32u) {
        C bv = CVT(C, b_row[k]);
#pragma unroll
        for (unsigned r = 0; r < SKINNY_ROWS; r++) {
            if (r < p.m) acc[r] += CVT(C, a[r * p.strides[0] + k * p.strides[1]]) * bv;
        }
    }
#pragma unroll
    for (unsigned r = 0; r < SKINNY_ROWS; r++) {
        if (r >= p.m) break;  // p.m is uniform: every lane takes the same sums
        C value = bg_warp_sum(acc[r]);
        if (lane != 0u || n >= p.n) continue;
        if (HAS_BIAS && split == 0u) value += CVT(C, bias[n]);
        out[(split * p.m + r) * p.n + n] = CVT(O, activation(value));
    }
}

// Large matmuls on the native executors (batchgpu/ops/matmul.py picks them): a BIG_WG (256) thread block
// computes a BIG x BIG (128 x 128) output tile. matmul_128 (any dtype): k advances BIG_K (8) at a time
// through tiles in shared memory; each thread keeps 8 x 8 accumulators, rows ty*4.. and 64+ty*4.., columns tx*4.. and
// 64+tx*4... Tiles are staged so that consecutive threads read consecutive addresses of whichever
// operand dimension has stride 1. Split-K as in matmul: grid y runs over m tiles x splits.
struct __align__(16) C4 {  // four accumulator-type values: one 16-byte shared memory read
    C v[4];
};

__device__ __forceinline__ void stage_k_major(unsigned e, unsigned k_extent, bool k_contiguous, unsigned& outer,
                                              unsigned& k) {
    // element e of a BIG x k_extent tile: k fastest when k has stride 1, else the outer index fastest
    if (k_contiguous) {
        outer = e / k_extent;
        k = e % k_extent;
    } else {
        outer = e % BIG;
        k = e / BIG;
    }
}

__device__ __forceinline__ void matmul_128_body(const A* a, const A* b, O* out, const Params& p, const A* bias) {
    __shared__ __align__(16) C a_tile[BIG_K][BIG];
    __shared__ __align__(16) C b_tile[BIG_K][BIG];
    unsigned tid = threadIdx.x, tx = tid % 16u, ty = tid / 16u;
    unsigned a_base, b_base;
    batch_bases(p, a_base, b_base);
    unsigned splits = p.split_k[1], split = blockIdx.y % splits;
    unsigned row0 = (blockIdx.y / splits) * BIG, col0 = blockIdx.x * BIG;
    C acc[8][8];
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 8; j++) acc[i][j] = (C)0;
    unsigned k_end = split_end(p, split);  // k_chunk is a multiple of BIG_K too
    for (unsigned k0 = split_first(p, split); k0 < k_end; k0 += BIG_K) {
        for (unsigned e = tid; e < BIG * BIG_K; e += BIG_WG) {
            unsigned outer, k;
            stage_k_major(e, BIG_K, p.strides[1] == 1u, outer, k);
            a_tile[k][outer] = load_a(a, p, a_base, row0 + outer, k0 + k);
            stage_k_major(e, BIG_K, p.strides[3] != 1u, outer, k);
            b_tile[k][outer] = load_b(b, p, b_base, k0 + k, col0 + outer);
        }
        __syncthreads();
#pragma unroll
        for (unsigned kk = 0; kk < BIG_K; kk++) {
            C4 a_lo = *(const C4*)&a_tile[kk][ty * 4u], a_hi = *(const C4*)&a_tile[kk][64u + ty * 4u];
            C4 b_lo = *(const C4*)&b_tile[kk][tx * 4u], b_hi = *(const C4*)&b_tile[kk][64u + tx * 4u];
            C av[8], bv[8];
            for (int j = 0; j < 4; j++) {
                av[j] = a_lo.v[j];
                av[4 + j] = a_hi.v[j];
                bv[j] = b_lo.v[j];
                bv[4 + j] = b_hi.v[j];
            }
            for (int i = 0; i < 8; i++)
                for (int j = 0; j < 8; j++) acc[i][j] += av[i] * bv[j];
        }
        __syncthreads();
    }
    unsigned out_base = (blockIdx.z * splits + split) * p.m * p.n;
    for (unsigned i = 0; i < 8u; i++) {
        unsigned row = row0 + (i < 4u ? ty * 4u + i : 64u + ty * 4u + (i - 4u));
        store_row(out, bias, p, out_base, row, col0 + tx * 4u, acc[i], split == 0u);
        store_row(out, bias, p, out_base, row, col0 + 64u + tx * 4u, acc[i] + 4, split == 0u);
    }
}

extern "C" __global__ void __launch_bounds__(BIG_WG) matmul_128(BG_ARGS) {
    matmul_128_body(a, b, out, p, bias);
}

// float16 on NVIDIA tensor cores: the same 128 x 128 tile and grid, 8 warps of 64 x 32 outputs, each
// a 4 x 4 grid of mma.sync m16n8k16 (float16 operands, float32 accumulators, as C = float does),
// k advancing 32 at a time. Shared tiles hold A as [m][k] and B as [n][k] (k contiguous, rows padded
// by 8 halves so the fragment loads of a warp hit 32 different banks). HIP (and the CPU test
// harness) run matmul_128's body instead. Not split-K aware (it always runs all of k, block y = m tile):
// batchgpu/ops/matmul.py launches it only when K takes one split; nobody could test a split path here.
#define MMA_K 32u

#ifndef BG_HIP
// float16 bits of an operand element (zero outside the matrix); only float16 operands take this kernel
__device__ __forceinline__ unsigned short half_bits(bg_half value) { return value.bits; }
template <typename T> __device__ __forceinline__ unsigned short half_bits(T value) { return bg_f2h((float)value).bits; }

__device__ __forceinline__ void mma_16x8x16(float* c, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// One operand's view for staging its 128 (outer: rows of A, columns of B) x 32 (k) tiles into a
// shared [outer][k] tile: element (outer, k) is op[base + outer * outer_stride + k * k_stride].
struct MmaOperand {
    const A* op;
    unsigned base, outer_extent, outer_stride, k_stride;
};

// How a tile is staged: whole and 8-element aligned tiles move 16 bytes per load (VEC_K: along k,
// stored as is; VEC_OUTER: along the outer dim, scattered into [outer][k]), the rest element by element.
enum MmaStaging { MMA_SCALAR, MMA_VEC_K, MMA_VEC_OUTER };

__device__ __forceinline__ MmaStaging mma_staging(const MmaOperand& o, unsigned outer0, unsigned k0, unsigned k_extent) {
    if (sizeof(A) != 2u || outer0 + BIG > o.outer_extent || k0 + MMA_K > k_extent || o.base % 8u) return MMA_SCALAR;
    if (o.k_stride == 1u && o.outer_stride % 8u == 0u) return MMA_VEC_K;
    if (o.outer_stride == 1u && o.k_stride % 8u == 0u) return MMA_VEC_OUTER;
    return MMA_SCALAR;
}

// 16-byte loads of a vector-staged tile into registers (two per thread), issued before the previous
// tile's mma work so they are in flight meanwhile.
__device__ __forceinline__ void mma_load(uint4* regs, const MmaOperand& o, MmaStaging how, unsigned outer0, unsigned k0) {
    for (unsigned c = 0; c < 2u; c++) {
        unsigned e = threadIdx.x + c * BIG_WG;
        unsigned at = how == MMA_VEC_K ? (outer0 + e / 4u) * o.outer_stride + k0 + (e % 4u) * 8u
                                       : (k0 + e / 16u) * o.k_stride + outer0 + (e % 16u) * 8u;
        regs[c] = *(const uint4*)(o.op + o.base + at);
    }
}

__device__ __forceinline__ void mma_store(unsigned short (*tile)[MMA_PAD], const uint4* regs, MmaStaging how) {
    for (unsigned c = 0; c < 2u; c++) {
        unsigned e = threadIdx.x + c * BIG_WG;
        if (how == MMA_VEC_K) {
            *(uint4*)&tile[e / 4u][(e % 4u) * 8u] = regs[c];
        } else {
            const unsigned short* halves = (const unsigned short*)&regs[c];
            unsigned k = e / 16u, outer = (e % 16u) * 8u;
            for (unsigned i = 0; i < 8u; i++) tile[outer + i][k] = halves[i];
        }
    }
}

__device__ __forceinline__ void mma_stage_scalar(unsigned short (*tile)[MMA_PAD], const MmaOperand& o, unsigned outer0,
                                                 unsigned k0, unsigned k_extent) {
    for (unsigned e = threadIdx.x; e < BIG * MMA_K; e += BIG_WG) {
        unsigned outer, k;
        stage_k_major(e, MMA_K, o.outer_stride != 1u, outer, k);
        unsigned at = outer0 + outer, ka = k0 + k;
        tile[outer][k] = at < o.outer_extent && ka < k_extent ? half_bits(o.op[o.base + at * o.outer_stride + ka * o.k_stride]) : 0;
    }
}
#endif

extern "C" __global__ void __launch_bounds__(BIG_WG) matmul_mma_f16(BG_ARGS) {
#ifdef BG_HIP
    matmul_128_body(a, b, out, p, bias);
#else
    __shared__ __align__(16) unsigned short a_tile[BIG][MMA_PAD];
    __shared__ __align__(16) unsigned short b_tile[BIG][MMA_PAD];
    unsigned tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5;
    unsigned group = lane >> 2, pair = (lane & 3u) * 2u;
    unsigned warp_m = (warp >> 2) * 64u, warp_n = (warp & 3u) * 32u;
    unsigned a_base, b_base;
    batch_bases(p, a_base, b_base);
    unsigned row0 = blockIdx.y * BIG, col0 = blockIdx.x * BIG;
    float acc[4][4][4] = {};
    const MmaOperand a_op = {a, a_base, p.m, p.strides[0], p.strides[1]};
    const MmaOperand b_op = {b, b_base, p.n, p.strides[3], p.strides[2]};
    uint4 a_regs[2], b_regs[2];
    MmaStaging a_how = mma_staging(a_op, row0, 0u, p.k), b_how = mma_staging(b_op, col0, 0u, p.k);
    if (a_how != MMA_SCALAR) mma_load(a_regs, a_op, a_how, row0, 0u);
    if (b_how != MMA_SCALAR) mma_load(b_regs, b_op, b_how, col0, 0u);
    for (unsigned k0 = 0; k0 < p.k; k0 += MMA_K) {
        if (a_how != MMA_SCALAR) mma_store(a_tile, a_regs, a_how);
        else mma_stage_scalar(a_tile, a_op, row0, k0, p.k);
        if (b_how != MMA_SCALAR) mma_store(b_tile, b_regs, b_how);
        else mma_stage_scalar(b_tile, b_op, col0, k0, p.k);
        __syncthreads();
        unsigned next = k0 + MMA_K;  // the next tile's loads fly while this one's mma run
        a_how = next < p.k ? mma_staging(a_op, row0, next, p.k) : MMA_SCALAR;
        b_how = next < p.k ? mma_staging(b_op, col0, next, p.k) : MMA_SCALAR;
        if (a_how != MMA_SCALAR) mma_load(a_regs, a_op, a_how, row0, next);
        if (b_how != MMA_SCALAR) mma_load(b_regs, b_op, b_how, col0, next);
#pragma unroll
        for (unsigned kk = 0; kk < MMA_K; kk += 16u) {
            unsigned af[4][4], bf[4][2];
#pragma unroll
            for (unsigned i = 0; i < 4u; i++) {
                unsigned r = warp_m + i * 16u + group;
                af[i][0] = *(const unsigned*)&a_tile[r][kk + pair];
                af[i][1] = *(const unsigned*)&a_tile[r + 8u][kk + pair];
                af[i][2] = *(const unsigned*)&a_tile[r][kk + pair + 8u];
                af[i][3] = *(const unsigned*)&a_tile[r + 8u][kk + pair + 8u];
            }
#pragma unroll
            for (unsigned j = 0; j < 4u; j++) {
                unsigned n = warp_n + j * 8u + group;
                bf[j][0] = *(const unsigned*)&b_tile[n][kk + pair];
                bf[j][1] = *(const unsigned*)&b_tile[n][kk + pair + 8u];
            }
#pragma unroll
            for (unsigned i = 0; i < 4u; i++)
#pragma unroll
                for (unsigned j = 0; j < 4u; j++) mma_16x8x16(acc[i][j], af[i], bf[j]);
        }
        __syncthreads();
    }
    unsigned out_base = blockIdx.z * p.m * p.n;
    for (unsigned i = 0; i < 4u; i++) {
        for (unsigned j = 0; j < 4u; j++) {
            unsigned row = row0 + warp_m + i * 16u + group, col = col0 + warp_n + j * 8u + pair;
            for (unsigned h = 0; h < 2u; h++) {
                unsigned r = row + h * 8u;
                if (r >= p.m) continue;
                for (unsigned c = 0; c < 2u; c++) {
                    if (col + c >= p.n) continue;
                    float value = acc[i][j][h * 2u + c];
                    if (HAS_BIAS) value += CVT(float, bias[col + c]);
                    out[out_base + r * p.n + col + c] = CVT(O, activation(value));
                }
            }
        }
    }
#endif
}
