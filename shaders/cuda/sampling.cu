// Token sampling for LLM decoding; mirrors shaders/wgsl/sampling.wgsl (batchgpu/ops/sampling.py has the numpy
// twin of every step). A (logits), O (penalize: the logits' type; sample: int), C (compute type of A).
// penalize: elementwise with per-row (repetition, presence, frequency) penalties. sample: one block per row;
// the first maximum of z = logit / T (NaN first), then SEARCH_PASSES passes of BIN_BITS bits over the
// order-preserving u32 image of z for the top_k threshold (rows with top_k), then as many for the top_p
// threshold over what top_k and min_p leave (rows with top_p; vLLM's order; masses in 32.32 fixed point:
// exact sums in any order), then the first maximum of z + Gumbel noise over the allowed elements.
// sample_masked: the same with the allowed-token bitmask `allowed` in rows with settings[row, 3] != 0
// (pass 1 skips disallowed elements, none allowed: id -1; the later passes see -inf there); other rows
// never read it. The WGSL twin keeps each invocation's bits in private memory (its `sample` entry must not
// use the binding); here the passes read the row's words directly.
// logprobs: one block per row of the raw logits (rows with top_k[row] < 0 write NaN and id -1 only): the
// first maximum (argmax's order: the first top id), the sum of exp(l - max), then one pass per further top
// id (the first element in argmax's order after the previous pick); rows of LOGPROB_WIDTH floats: the
// target's logprob, MAX_TOP ids, MAX_TOP logprobs.
// count_reset, count_add: zero flagged rows of counts, add 1 per valid (slot, id) (atomics).

//!interface

typedef int Counter;  // atomic<i32> in the WGSL twin

extern "C" __global__ void penalize(BG_ARGS) {
    unsigned i = bg_thread_index();
    if (i >= p.rows * p.width) return;
    unsigned row = i / p.width;
    float l = CVT(float, logits[i]);
    if (seen[i] > 0) {
        float r = penalties[row * 3u];
        l = l > 0.0f ? l / r : l * r;
    }
    int g = generated[i];
    l -= penalties[row * 3u + 1u] * (g > 0 ? 1.0f : 0.0f) + penalties[row * 3u + 2u] * (float)g;
    out[i] = CVT(O, l);
}

extern "C" __global__ void count_reset(BG_ARGS) {
    unsigned i = bg_thread_index();
    if (i >= p.rows * p.width) return;
    if (reset[i / p.width] != 0) counts[i] = 0;
}

extern "C" __global__ void count_add(BG_ARGS) {
    unsigned i = bg_thread_index();
    if (i >= p.count) return;
    int slot = slots[i], id = ids[i];
    if (slot >= 0 && (unsigned)slot < p.rows && id >= 0 && (unsigned)id < p.width) {
        bg_atomic_add(&counts[(unsigned)slot * p.width + (unsigned)id], 1);
    }
}

// z of element k of the row at `row_logits`: logit / t when sampling, else the logit.
__device__ __forceinline__ float scaled(const A* row_logits, unsigned k, float t, bool sampling) {
    float l = CVT(float, row_logits[k]);
    return sampling ? l / t : l;
}

__device__ __forceinline__ bool is_finite(float x) { return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u; }

// The order-preserving u32 image of a float: a < b (as floats, -0 == +0) iff key(a) < key(b).
__device__ __forceinline__ unsigned order_key(float z) {
    unsigned bits = __float_as_uint(z);
    if (bits == 0x80000000u) bits = 0u;
    return bits >= 0x80000000u ? ~bits : bits | 0x80000000u;
}

// Standard Gumbel noise -log(-log(u)); for u > 15/16, -log(u) is the series of -log(1 - w), w = 1 - u.
__device__ __forceinline__ float gumbel(unsigned seed, unsigned counter, unsigned index) {
    float u = bg_hash_uniform(bg_hash3(seed, counter, index));
    float w = 1.0f - u;
    float e = -logf(u);
    if (w < 0.0625f) {
        e = w * (1.0f + w * (0.5f + w * (0.33333334f + w * (0.25f + w * (0.2f + w * 0.16666667f)))));
    }
    return -logf(e);
}

// Adds the 32.32 fixed-point mass (high, low) to bucket b of the block.
__device__ __forceinline__ void add_mass(unsigned* mass_low, unsigned* mass_high, unsigned b, unsigned high,
                                         unsigned low) {
    unsigned old = bg_atomic_add(&mass_low[b], low);
    unsigned carried = high + (old + low < old ? 1u : 0u);
    if (carried != 0u) bg_atomic_add(&mass_high[b], carried);
}

// Bucket b's mass as float (one rounding: high < 2^24).
__device__ __forceinline__ float mass_of(const unsigned* mass_low, const unsigned* mass_high, unsigned b) {
    return (float)mass_high[b] * 4294967296.0f + (float)mass_low[b];
}

// z of element i of the row as the passes after the first see it: -inf where the row is masked (its words of
// the allowed bitmask: row_allowed, null for unmasked rows) and i is not allowed.
__device__ __forceinline__ float visible(const A* row_logits, const unsigned* row_allowed, unsigned i, float t,
                                         bool sampling) {
    const bool hidden = row_allowed != nullptr && ((row_allowed[i >> 5] >> (i & 31u)) & 1u) == 0u;
    const float z = scaled(row_logits, i, t, sampling);
    return hidden ? __uint_as_float(0xff800000u) : z;  // a select, not a branch: the lanes of a warp agree
}

// The rest of sample and sample_masked from the thread's first maximum (value, index) of pass 1.
__device__ __forceinline__ void draw(const Params& p, const A* logits, const float* settings, const int* top_k,
                                     const unsigned* keys, O* out, const unsigned* row_allowed, float value,
                                     unsigned index) {
    __shared__ float best_value[WG];
    __shared__ unsigned best_index[WG];
    __shared__ unsigned mass_low[BINS], mass_high[BINS];  // the buckets' masses in 32.32 fixed point
    __shared__ unsigned key_counts[BINS];
    __shared__ unsigned k_low, p_low;      // first keys of the search intervals (the thresholds once done)
    __shared__ unsigned search_passes;     // SEARCH_PASSES for each of top_k and top_p that is on
    const unsigned lid = threadIdx.x;
    const unsigned item = bg_block_index();
    const unsigned row = bg_min(item, p.rows - 1u);
    const A* row_logits = logits + row * p.width;
    const float t = settings[row * 4u], top_p = settings[row * 4u + 1u], min_p = settings[row * 4u + 2u];
    const int k = top_k[row];
    const unsigned seed = keys[row * 2u], counter = keys[row * 2u + 1u];
    const bool sampling = t > 0.0f;
    if (lid == 0u) k_low = p_low = 0u;
    const unsigned greedy = bg_tree_best(best_value, best_index, lid, value, index);
    const bool none = greedy == NO_INDEX;  // a masked row with no allowed token
    const float z_max = none ? __uint_as_float(0xff800000u) : scaled(row_logits, greedy, t, sampling);
    const bool random = sampling && is_finite(z_max);
    const unsigned key_max = order_key(z_max);
    const bool k_on = random && k > 0 && (unsigned)k < p.width;
    const bool p_on = random && top_p < 1.0f;
    const unsigned k_passes = k_on ? SEARCH_PASSES : 0u;
    if (lid == 0u) search_passes = k_passes + (p_on ? SEARCH_PASSES : 0u);
    __syncthreads();
    const unsigned passes = search_passes;  // the same in every thread: the passes' barriers are skipped with them

    // 2. The thresholds in vLLM's order: top_k's key (passes of counts), then top_p's over what top_k and
    // min_p leave (passes of masses; the target is top_p of that set's mass, summed in its first pass);
    // BIN_BITS bits of each key per pass from the top (thread 0 keeps the tails).
    unsigned k_above = 0u;
    float p_above = 0.0f, p_target = 0.0f;
    for (unsigned level = 0u; level < passes; ++level) {
        const bool counting = level < k_passes;  // a pass of top_k's search (else of top_p's)
        const unsigned shift = (SEARCH_PASSES - 1u - level % SEARCH_PASSES) * BIN_BITS;
        if (lid < BINS) key_counts[lid] = mass_low[lid] = mass_high[lid] = 0u;
        __syncthreads();
        const unsigned first = counting ? k_low : p_low;
        const unsigned kept_from = k_on ? bg_min(k_low, key_max) : 0u;  // top_k's threshold (settled in its passes)
        unsigned low[BINS], high[BINS];
        for (unsigned b = 0u; b < BINS; ++b) low[b] = high[b] = 0u;
        for (unsigned i = lid; i < p.width; i += WG) {
            float z = visible(row_logits, row_allowed, i, t, sampling);
            unsigned key = order_key(z);
            unsigned b = (key - first) >> shift;
            if (key < first || b >= BINS) continue;
            if (counting) {
                bg_atomic_add(&key_counts[b], 1u);
                continue;
            }
            float e = expf(z - z_max);
            if ((key >= kept_from && e >= min_p) || key == key_max) {
                // e in 32.32 fixed point, truncated below 2^-32 (e * 2^32 is exact in float)
                unsigned whole = (unsigned)e;
                unsigned fraction = (unsigned)((e - (float)whole) * 4294967296.0f);
                low[b] += fraction;
                high[b] += whole + (low[b] < fraction ? 1u : 0u);
            }
        }
        for (unsigned b = 0u; b < BINS; ++b) {
            if ((low[b] | high[b]) != 0u) add_mass(mass_low, mass_high, b, high[b], low[b]);
        }
        __syncthreads();
        // thread 0: the highest bucket whose tail (everything above the interval, then the buckets from the top
        // down to it) reaches the target; none (float tails rounded otherwise than in the first pass): bucket 0
        if (lid == 0u && counting) {
            unsigned tail = 0u, pick = 0u, skip = 0u;
            bool found = false;
            for (unsigned j = 0u; j < BINS; ++j) {
                unsigned b = BINS - 1u - j;
                unsigned next = tail + key_counts[b];
                if (!found && k_above + next >= (unsigned)k) {
                    pick = b;
                    skip = tail;
                    found = true;
                }
                tail = next;
            }
            if (!found) skip = tail - key_counts[0];
            k_above += skip;
            k_low = first + (pick << shift);
        }
        if (lid == 0u && !counting) {
            if (level == k_passes) {
                float total = 0.0f;
                for (unsigned b = 0u; b < BINS; ++b) total += mass_of(mass_low, mass_high, b);
                p_target = top_p * total;
            }
            float tail = 0.0f, skip = 0.0f;
            unsigned pick = 0u;
            bool found = false;
            for (unsigned j = 0u; j < BINS; ++j) {
                unsigned b = BINS - 1u - j;
                float next = tail + mass_of(mass_low, mass_high, b);
                if (!found && p_above + next >= p_target) {
                    pick = b;
                    skip = tail;
                    found = true;
                }
                tail = next;
            }
            if (!found) skip = tail - mass_of(mass_low, mass_high, 0u);
            p_above += skip;
            p_low = first + (pick << shift);
        }
        __syncthreads();
    }
    const unsigned k_threshold = k_on ? bg_min(k_low, key_max) : 0u;
    const unsigned p_threshold = p_on ? bg_min(p_low, key_max) : 0u;

    // 3. The first maximum of z + Gumbel noise over the allowed elements.
    float score = z_max + gumbel(seed, counter, greedy);  // the maximum is always allowed
    unsigned chosen = greedy;
    const unsigned drawn = random ? p.width : 0u;
    for (unsigned i = lid; i < drawn; i += WG) {
        float z = visible(row_logits, row_allowed, i, t, sampling);
        unsigned key = order_key(z);
        if ((key >= k_threshold && key >= p_threshold && expf(z - z_max) >= min_p) || key == key_max) {
            float s = z + gumbel(seed, counter, i);
            if (s > score || (s == score && i < chosen)) {
                score = s;
                chosen = i;
            }
        }
    }
    const unsigned picked = bg_tree_best(best_value, best_index, lid, score, chosen);
    if (lid == 0u && item < p.rows) out[item] = CVT(O, none ? -1 : (int)picked);
}

extern "C" __global__ void sample(BG_ARGS) {
    const unsigned row = bg_min(bg_block_index(), p.rows - 1u);
    const A* row_logits = logits + row * p.width;
    const float t = settings[row * 4u];
    const bool sampling = t > 0.0f;

    // 1. The first maximum of z (NaN first): the greedy id, and z_max.
    float value = scaled(row_logits, 0u, t, sampling);
    unsigned index = 0u;
    for (unsigned i = threadIdx.x; i < p.width; i += WG) {
        float v = scaled(row_logits, i, t, sampling);
        if (bg_better(v, i, value, index)) {
            value = v;
            index = i;
        }
    }
    draw(p, logits, settings, top_k, keys, out, nullptr, value, index);
}

extern "C" __global__ void sample_masked(BG_ARGS) {
    const unsigned row = bg_min(bg_block_index(), p.rows - 1u);
    const A* row_logits = logits + row * p.width;
    const float t = settings[row * 4u];
    const bool sampling = t > 0.0f;
    // rows with settings[row, 3] != 0: their words of the bitmask (unmasked rows never read it)
    const unsigned* row_allowed = settings[row * 4u + 3u] != 0.0f ? allowed + row * ((p.width + 31u) / 32u) : nullptr;

    // 1. The first maximum of z over the allowed elements (NaN first; none: NO_INDEX).
    float value = row_allowed ? __uint_as_float(0xff800000u) : scaled(row_logits, 0u, t, sampling);
    unsigned index = row_allowed ? NO_INDEX : 0u;
    for (unsigned i = threadIdx.x; i < p.width; i += WG) {
        const bool allowed_here = row_allowed == nullptr || ((row_allowed[i >> 5] >> (i & 31u)) & 1u) != 0u;
        float v = scaled(row_logits, i, t, sampling);
        if (allowed_here && bg_better(v, i, value, index)) {
            value = v;
            index = i;
        }
    }
    draw(p, logits, settings, top_k, keys, out, row_allowed, value, index);
}

// The logprob l - lse, or NaN where the row's maximum is not finite.
__device__ __forceinline__ float logprob_of(float l, float lse, bool finite) {
    return finite ? l - lse : __uint_as_float(0x7fc00000u);
}

extern "C" __global__ void logprobs(BG_ARGS) {
    __shared__ float best_value[WG];
    __shared__ unsigned best_index[WG];
    __shared__ float partial[WG];
    const unsigned lid = threadIdx.x;
    const unsigned item = bg_block_index();
    const unsigned row = bg_min(item, p.rows - 1u);
    const A* row_logits = logits + row * p.width;
    O* row_out = out + item * LOGPROB_WIDTH;  // O is float for this entry (the module compiles per launch)
    const bool live = item < p.rows;
    const int n = top_k[row];
    const unsigned ranks = n >= 0 ? bg_min((unsigned)n, bg_min((unsigned)MAX_TOP, p.width)) + 1u : 0u;
    if (live && lid == 0u) {  // thread 0 writes the whole row (first NaN, id -1; then what it computes)
        for (unsigned j = 0u; j < LOGPROB_WIDTH; ++j) {
            row_out[j] = CVT(O, (j >= 1u && j <= MAX_TOP) ? -1.0f : __uint_as_float(0x7fc00000u));
        }
    }
    if (ranks == 0u) return;  // the same in every thread of the block

    // 1. The first maximum (the first top id) and 2. the sum of exp(l - m).
    float value = CVT(float, row_logits[0]);
    unsigned index = 0u;
    for (unsigned i = lid; i < p.width; i += WG) {
        float v = CVT(float, row_logits[i]);
        if (bg_better(v, i, value, index)) {
            value = v;
            index = i;
        }
    }
    unsigned pick = bg_tree_best(best_value, best_index, lid, value, index);
    const float m = CVT(float, row_logits[pick]);
    const bool finite = is_finite(m);
    float total = 0.0f;
    for (unsigned i = lid; i < p.width; i += WG) total += expf(CVT(float, row_logits[i]) - m);
    const float lse = m + logf(bg_tree(partial, lid, total, false));
    const int wanted = ids[row];
    if (live && lid == 0u && wanted >= 0 && (unsigned)wanted < p.width) {
        row_out[0] = CVT(O, logprob_of(CVT(float, row_logits[wanted]), lse, finite));
    }

    // 3. The top ids: rank r is the first element in argmax's order after rank r - 1's.
    for (unsigned rank = 0u; rank + 1u < ranks; ++rank) {
        const float previous = CVT(float, row_logits[pick]);
        if (rank > 0u) {
            value = __uint_as_float(0xff800000u);  // (-inf, no index): after every element in argmax's order
            index = 0xffffffffu;
            for (unsigned i = lid; i < p.width; i += WG) {
                float v = CVT(float, row_logits[i]);
                if (bg_better(previous, pick, v, i) && bg_better(v, i, value, index)) {
                    value = v;
                    index = i;
                }
            }
            pick = bg_tree_best(best_value, best_index, lid, value, index);
        }
        if (live && lid == 0u) {
            row_out[1u + rank] = CVT(O, (float)pick);
            row_out[1u + MAX_TOP + rank] = CVT(O, logprob_of(CVT(float, row_logits[pick]), lse, finite));
        }
    }
}
