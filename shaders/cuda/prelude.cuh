// Prepended to every kernel of shaders/cuda/ (and to custom CUDA kernels). No #include: NVRTC and
// hipRTC compile it without a toolkit's headers. CUDA/HIP differences live behind BG_HIP.
// The executor puts the type aliases (A, B, O, C), op expressions and constants in #defines above it.

#if defined(__HIPCC_RTC__) || defined(__HIP_PLATFORM_AMD__) || defined(__HIP__)
#define BG_HIP 1
#endif

#ifndef WG
#define WG 256
#endif

// float16 storage type. Arithmetic is done in float (C = float), as in the WGSL kernels.
#ifdef BG_HIP
struct __align__(2) bg_half { _Float16 v; };
__device__ __forceinline__ float bg_h2f(bg_half h) { return (float)h.v; }
__device__ __forceinline__ bg_half bg_f2h(float f) { bg_half h; h.v = (_Float16)f; return h; }
__device__ __forceinline__ float bg_bits2f(unsigned bits) {
    unsigned short s = (unsigned short)bits;
    return (float)__builtin_bit_cast(_Float16, s);
}
#else
struct __align__(2) bg_half { unsigned short bits; };
__device__ __forceinline__ float bg_bits2f(unsigned bits) {
    float f;
    unsigned short s = (unsigned short)bits;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(s));
    return f;
}
__device__ __forceinline__ float bg_h2f(bg_half h) { return bg_bits2f(h.bits); }
__device__ __forceinline__ bg_half bg_f2h(float f) {
    bg_half h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
    return h;
}
#endif

// float16 rounding of a float value, kept as float (a fused kernel's float16 intermediate; mirrors round_f16
// of shaders/wgsl/lib/half.wgsl): PTX's cvt.rn.f16.f32 (to nearest even, overflow to inf) is an explicit
// instruction in inline assembly that no compiler folds; on HIP a C cast to _Float16, which C requires to round.
__device__ __forceinline__ float bg_round_f16(float v) { return bg_h2f(bg_f2h(v)); }

// float -> int and unsigned as batchgpu's cast defines it (PTX's cvt.rzi, Rust's `as`; mirrors
// shaders/wgsl/lib/convert.wgsl): toward zero, saturating at the type's bounds (inf included), NaN to 0.
// The bits are tested first: C++'s conversion of a value out of range is undefined behaviour.
__device__ __forceinline__ int bg_f2i(float x) {
    unsigned bits = __float_as_uint(x), magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return 0;                                            // NaN
    if (magnitude >= 0x4f000000u) return bits != magnitude ? -2147483647 - 1 : 2147483647;  // |x| >= 2^31
    return (int)x;
}
__device__ __forceinline__ unsigned bg_f2u(float x) {
    unsigned bits = __float_as_uint(x);
    if (bits > 0x7f800000u) return 0u;            // NaN and every negative value (-0 and above -1 included)
    if (bits >= 0x4f800000u) return 0xffffffffu;  // 2^32 and up, inf
    return (unsigned)x;
}

// CVT(T, x): WGSL's T(x) conversion, except float -> int and unsigned: bg_f2i / bg_f2u; anything ->
// float16 goes through float.
template <typename T> struct bg_conv {
    template <typename S> static __device__ __forceinline__ T from(S x) { return (T)x; }
    static __device__ __forceinline__ T from(bg_half x) { return (T)bg_h2f(x); }
};
template <> struct bg_conv<int> {
    template <typename S> static __device__ __forceinline__ int from(S x) { return (int)x; }
    static __device__ __forceinline__ int from(float x) { return bg_f2i(x); }
    static __device__ __forceinline__ int from(bg_half x) { return bg_f2i(bg_h2f(x)); }
};
template <> struct bg_conv<unsigned> {
    template <typename S> static __device__ __forceinline__ unsigned from(S x) { return (unsigned)x; }
    static __device__ __forceinline__ unsigned from(float x) { return bg_f2u(x); }
    static __device__ __forceinline__ unsigned from(bg_half x) { return bg_f2u(bg_h2f(x)); }
};
template <> struct bg_conv<bg_half> {
    template <typename S> static __device__ __forceinline__ bg_half from(S x) { return bg_f2h((float)x); }
    static __device__ __forceinline__ bg_half from(bg_half x) { return x; }
};
#define CVT(T, x) (bg_conv<T>::from(x))

// WGSL's abs/max/min over f32, i32 and u32.
__device__ __forceinline__ float bg_abs(float x) { return fabsf(x); }
__device__ __forceinline__ int bg_abs(int x) { return x < 0 ? -x : x; }
__device__ __forceinline__ unsigned bg_abs(unsigned x) { return x; }
__device__ __forceinline__ float bg_max(float x, float y) { return fmaxf(x, y); }
__device__ __forceinline__ int bg_max(int x, int y) { return x > y ? x : y; }
__device__ __forceinline__ unsigned bg_max(unsigned x, unsigned y) { return x > y ? x : y; }
__device__ __forceinline__ float bg_min(float x, float y) { return fminf(x, y); }
__device__ __forceinline__ int bg_min(int x, int y) { return x < y ? x : y; }
__device__ __forceinline__ unsigned bg_min(unsigned x, unsigned y) { return x < y ? x : y; }
__device__ __forceinline__ float bg_clamp(float x, float lo, float hi) { return fminf(fmaxf(x, lo), hi); }

// NaN by bit pattern, as the WGSL kernels test it (shaders/wgsl/lib/nan.wgsl); integer data never is NaN,
// whatever its bits (float16 data computes as float: C = float).
__device__ __forceinline__ bool bg_is_nan(float v) { return (__float_as_uint(v) & 0x7fffffffu) > 0x7f800000u; }
__device__ __forceinline__ bool bg_is_nan(int) { return false; }
__device__ __forceinline__ bool bg_is_nan(unsigned) { return false; }
// argmax's order: whether (v, k) comes before (best, at): NaN first, then the larger value, then the lower index.
template <typename T> __device__ __forceinline__ bool bg_better(T v, unsigned k, T best, unsigned at) {
    bool v_nan = bg_is_nan(v), best_nan = bg_is_nan(best);
    if (v_nan || best_nan) return v_nan && (!best_nan || k < at);
    return v > best || (v == best && k < at);
}
// The index of the best (value, index) pair of the block in argmax's order, over shared arrays of
// blockDim.x (a power of two) entries; every thread must call it (barriers).
template <typename T>
__device__ unsigned bg_tree_best(T* best_value, unsigned* best_index, unsigned lid, T value, unsigned index) {
    best_value[lid] = value;
    best_index[lid] = index;
    __syncthreads();
    for (unsigned stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        unsigned other = lid + stride;
        if (lid < stride && bg_better(best_value[other], best_index[other], best_value[lid], best_index[lid])) {
            best_value[lid] = best_value[other];
            best_index[lid] = best_index[other];
        }
        __syncthreads();
    }
    unsigned result = best_index[0];
    __syncthreads();
    return result;
}
// numpy's np.maximum/np.minimum: NaN if either operand is (fmaxf/fminf, like WGSL's max/min, return the
// other operand).
template <typename T> __device__ __forceinline__ T bg_max_nan(T x, T y) {
    return bg_is_nan(x) ? x : bg_is_nan(y) ? y : bg_max(x, y);
}
template <typename T> __device__ __forceinline__ T bg_min_nan(T x, T y) {
    return bg_is_nan(x) ? x : bg_is_nan(y) ? y : bg_min(x, y);
}

// Phi(-a) = erfc(a / sqrt(2)) / 2 for a >= 0 and exact GELU x * Phi(x); mirrors normal_tail/gelu_erf
// of shaders/wgsl/elementwise.wgsl (erfcc with exp(-a^2 / 2) split so that no rounding of a is amplified).
__device__ __forceinline__ float bg_normal_tail(float a) {
    float t = 1.0f / (1.0f + 0.35355339059327373f * a);
    float poly = -1.26551223f + t * (1.00002368f + t * (0.37409196f + t * (0.09678418f + t * (-0.18628806f
               + t * (0.27886807f + t * (-1.13520398f + t * (1.48851587f + t * (-0.82215223f + t * 0.17087277f))))))));
    float ah = truncf(a * 256.0f) * (1.0f / 256.0f);
    return 0.5f * t * expf(-0.5f * ah * ah) * expf(-0.5f * (a - ah) * (a + ah) + poly);
}
__device__ __forceinline__ float bg_gelu_erf(float x) {
    float tail = fabsf(x) > 16.0f ? 0.0f : bg_normal_tail(fabsf(x));
    return x * (x >= 0.0f ? 1.0f - tail : tail);
}

// The WGSL kernels' linear index over a 1-D count split across grid x and y:
// wg.x + wg.y * num_workgroups.x, times the block size, plus the local index.
__device__ __forceinline__ unsigned bg_block_index() { return blockIdx.x + blockIdx.y * gridDim.x; }
__device__ __forceinline__ unsigned bg_thread_index() { return bg_block_index() * blockDim.x + threadIdx.x; }

#define BG_NO_SLOT 0xFFFFFFFFu

// A piece of a long row (one block per piece, rows after rows); mirrors shaders/wgsl/lib/pieces.wgsl.
struct BgPiece {
    unsigned row, first, count, index;  // first: counted from the row's start; index: row * chunks + piece
    bool valid;                         // false past the last piece (such blocks only take part in barriers)
};

// Block `index`'s piece of `rows` rows of `length` elements cut into pieces of `chunk`.
__device__ __forceinline__ BgPiece bg_piece_at(unsigned index, unsigned rows, unsigned length, unsigned chunk) {
    unsigned chunks = (length - 1u) / chunk + 1u;
    unsigned clamped = bg_min(index, rows * chunks - 1u);
    unsigned first = (clamped % chunks) * chunk;
    return BgPiece{clamped / chunks, first, bg_min(chunk, length - first), index, index < rows * chunks};
}

// Sum of `value` over each aligned group of 32 lanes (a CUDA warp; half an AMD wave64): every lane
// of the group must call it and gets the sum.
template <typename T> __device__ __forceinline__ T bg_warp_sum(T value) {
    for (int offset = 16; offset > 0; offset >>= 1) {
#ifdef BG_HIP
        value += __shfl_xor(value, offset);
#else
        value += __shfl_xor_sync(0xFFFFFFFFu, value, offset);
#endif
    }
    return value;
}

// Block tree reductions of one float per thread over `partial[WG]` in shared memory (WG a power of
// two); every thread of the block must call them (they hold barriers). Twin of wgsl/lib/tree.wgsl: the
// max propagates NaN.
__device__ float bg_tree(float* partial, unsigned lid, float value, bool take_max) {
    partial[lid] = value;
    __syncthreads();
    for (unsigned stride = WG / 2; stride > 0; stride >>= 1) {
        if (lid < stride) {
            partial[lid] = take_max ? bg_max_nan(partial[lid], partial[lid + stride]) : partial[lid] + partial[lid + stride];
        }
        __syncthreads();
    }
    float result = partial[0];
    __syncthreads();
    return result;
}

// Counter-based random numbers; mirrors shaders/wgsl/lib/random.wgsl (and batchgpu/ops/sampling.py): a
// 32-bit hash of (seed, counter, index) from nested PCG hashes, and (m + 0.5) / 2^23 for its top 23 bits m,
// a uniform number in (0, 1) exact in float (never 0 or 1).
__device__ __forceinline__ unsigned bg_pcg_hash(unsigned v) {
    unsigned state = v * 747796405u + 2891336453u;
    unsigned word = ((state >> ((state >> 28u) + 4u)) ^ state) * 277803737u;
    return (word >> 22u) ^ word;
}
__device__ __forceinline__ unsigned bg_hash3(unsigned seed, unsigned counter, unsigned index) {
    return bg_pcg_hash(seed ^ bg_pcg_hash(counter ^ bg_pcg_hash(index)));
}
__device__ __forceinline__ float bg_hash_uniform(unsigned h) {
    return ((float)(h >> 9u) + 0.5f) * 1.1920928955078125e-7f;
}

// atomicAdd on global or shared int/unsigned. Compiled as plain C++ (the tests' CPU harness,
// tests/cuda_cpu.py, runs one block at a time and switches threads only at barriers) a plain add is atomic.
#if defined(__CUDACC__) || defined(__HIPCC__) || defined(__HIPCC_RTC__)
template <typename T> __device__ __forceinline__ T bg_atomic_add(T* address, T value) {
    return atomicAdd(address, value);
}
#else
template <typename T> __device__ __forceinline__ T bg_atomic_add(T* address, T value) {
    T old = *address;
    *address = old + value;
    return old;
}
#endif
