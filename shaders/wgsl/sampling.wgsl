// Token sampling for LLM decoding; batchgpu/ops/sampling.py has the numpy twin of every step and the loop
// count behind its MAX_VOCAB. Aliases: A (logits), O (penalize: the logits' type; sample: i32), C (compute
// type of A). Every launch of the family has float logits types (the whole module compiles per launch).
//
// penalize: elementwise over (rows, width) with per-row (repetition, presence, frequency) penalties.
// sample: one workgroup per row. Pass 1 finds the first maximum of z = logit / T (NaN first, as argmax); rows
// with T <= 0 or whose maximum is not finite take its index. Rows with top_k on then take SEARCH_PASSES passes
// that find, over the order-preserving u32 image of z (order_key), the k-th largest key; rows with top_p on
// then SEARCH_PASSES passes that find the largest key whose upper tail holds top_p of the mass exp(z - z_max)
// of the elements top_k and min_p leave (vLLM's order); a workgroup-uniform pass count, so the passes'
// barriers are skipped with them. BIN_BITS bits per pass: each pass spreads the elements inside the current
// key interval over BINS buckets (counts by workgroup atomics; masses in 32.32 fixed point, per invocation,
// then merged by workgroup atomics: exact sums in any order), and invocation 0 keeps the highest bucket whose
// tail reaches the target.
// The last pass takes the first maximum of z + Gumbel noise over the allowed elements.
// sample_masked: the same with an allowed-token bitmask (binding `allowed`, which `sample` has not, so that
// its launches keep their bindings): in rows with settings[row, 3] != 0, pass 1 reads each element's bit
// once (into the invocation's private bits) and skips disallowed elements (none allowed: id -1); the later
// passes see -inf there (`visible`). Other rows never read the mask.
// logprobs: one workgroup per row of the raw logits (rows with top_k[row] < 0 write NaN and id -1 only):
// pass 1 the first maximum (argmax's order, NaN first: the first top id), pass 2 the sum of exp(l - max)
// (a workgroup tree), then one pass per further top id: the first element in argmax's order after the
// previous pick. Output rows of LOGPROB_WIDTH f32: the target's logprob, MAX_TOP ids, MAX_TOP logprobs.
// count_reset, count_add: zero the rows of counts whose reset flag is set, then add 1 per valid (slot, id).

//!interface

// is_nan_f32 (bit pattern), argmax's order and its (value, index) tree over C = f32 (the sample launch
// sets IS_FLOAT), and the counter-based hash.
//!include nan
//!include best
//!include random
//!include tree

alias Counter = atomic<i32>;

var<workgroup> mass_low: array<atomic<u32>, BINS>;   // the buckets' masses in 32.32 fixed point
var<workgroup> mass_high: array<atomic<u32>, BINS>;
var<workgroup> key_counts: array<atomic<u32>, BINS>;
var<workgroup> k_low: u32;   // first key of the top_k search interval (the threshold once done)
var<workgroup> p_low: u32;   // first key of the top_p search interval
var<workgroup> search_passes: u32;   // SEARCH_PASSES for each of top_k and top_p that is on
var<workgroup> rank_count: u32;   // logprobs: top ids the row asks for, + 1 (0: the row is skipped)

@compute @workgroup_size(WG)
fn penalize(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = gid.x + gid.y * groups.x * WG;
    if i >= p.rows * p.width { return; }
    let row = i / p.width;
    var l = f32(logits[i]);
    if seen[i] > 0 {
        let r = penalties[row * 3u];
        l = select(l * r, l / r, l > 0.0);
    }
    let g = generated[i];
    l -= penalties[row * 3u + 1u] * select(0.0, 1.0, g > 0) + penalties[row * 3u + 2u] * f32(g);
    out[i] = O(l);
}

@compute @workgroup_size(WG)
fn count_reset(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = gid.x + gid.y * groups.x * WG;
    if i >= p.rows * p.width { return; }
    if reset[i / p.width] != 0 { atomicStore(&counts[i], 0); }
}

@compute @workgroup_size(WG)
fn count_add(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = gid.x + gid.y * groups.x * WG;
    if i >= p.count { return; }
    let slot = slots[i];
    let id = ids[i];
    if slot >= 0 && u32(slot) < p.rows && id >= 0 && u32(id) < p.width {
        atomicAdd(&counts[u32(slot) * p.width + u32(id)], 1);
    }
}

// z of element k of the row starting at `base`: logit / t when sampling, else the logit.
fn scaled(k: u32, base: u32, t: f32, sampling: bool) -> f32 {
    let l = f32(logits[base + k]);
    return select(l, l / t, sampling);
}

fn is_finite(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7f800000u) != 0x7f800000u;
}

// The order-preserving u32 image of a float: a < b (as floats, -0 == +0) iff key(a) < key(b).
fn order_key(z: f32) -> u32 {
    var bits = bitcast<u32>(z);
    if bits == 0x80000000u { bits = 0u; }
    return select(bits | 0x80000000u, ~bits, bits >= 0x80000000u);
}

// Standard Gumbel noise -log(-log(u)) of element `index` of the stream (seed, counter). For u > 15/16,
// -log(u) is the series of -log(1 - w) in w = 1 - u (exact): log near 1 is only bounded in absolute error
// on GPUs (WGSL, Vulkan), and there the noise is large and decides the draw.
fn gumbel(seed: u32, counter: u32, index: u32) -> f32 {
    let u = hash_uniform(hash3(seed, counter, index));
    let w = 1.0 - u;
    var e = -log(u);
    if w < 0.0625 {
        e = w * (1.0 + w * (0.5 + w * (0.33333334 + w * (0.25 + w * (0.2 + w * 0.16666667)))));
    }
    return -log(e);
}

// Adds the 32.32 fixed-point mass (high, low) to bucket b of the workgroup.
fn add_mass(b: u32, high: u32, low: u32) {
    let old = atomicAdd(&mass_low[b], low);
    let carried = high + select(0u, 1u, old + low < old);
    if carried != 0u { atomicAdd(&mass_high[b], carried); }
}

// Bucket b's mass as f32 (one rounding: high < 2^24).
fn mass_of(b: u32) -> f32 {
    return f32(atomicLoad(&mass_high[b])) * 4294967296.0 + f32(atomicLoad(&mass_low[b]));
}

// sample_masked's allowed bits of the invocation's elements lid + j * WG (bit j & 31 of word j >> 5), read from
// `allowed` once per element in its first pass; row_masked: settings[row, 3] != 0 there (false in `sample`,
// which never reads `allowed`: it has no such binding).
var<private> allowed_bits: array<u32, MASK_WORDS>;
var<private> row_masked: bool;

// z of the invocation's element i (i % WG == lid) as the passes after the first see it: -inf where the row is
// masked and i is not allowed.
fn visible(i: u32, base: u32, t: f32, sampling: bool) -> f32 {
    let j = i / WG;
    let hidden = row_masked && ((allowed_bits[j >> 5u] >> (j & 31u)) & 1u) == 0u;
    return select(scaled(i, base, t, sampling), from_bits(0xff800000u), hidden);   // no branch: lanes agree
}

@compute @workgroup_size(WG)
fn sample(@builtin(local_invocation_id) local_id: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
          @builtin(num_workgroups) groups: vec3<u32>) {
    let lid = local_id.x;
    let item = wid.x + wid.y * groups.x;
    let row = min(item, p.rows - 1u);
    let base = row * p.width;
    let t = settings[row * 4u];
    let sampling = t > 0.0;

    // 1. The first maximum of z (NaN first): the greedy id, and z_max.
    var value = scaled(0u, base, t, sampling);
    var index = 0u;
    for (var i = lid; i < p.width; i += WG) {
        let v = scaled(i, base, t, sampling);
        if better(v, i, value, index) { value = v; index = i; }
    }
    draw(lid, item, value, index);
}

@compute @workgroup_size(WG)
fn sample_masked(@builtin(local_invocation_id) local_id: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
                 @builtin(num_workgroups) groups: vec3<u32>) {
    let lid = local_id.x;
    let item = wid.x + wid.y * groups.x;
    let row = min(item, p.rows - 1u);
    let base = row * p.width;
    let t = settings[row * 4u];
    let sampling = t > 0.0;
    row_masked = settings[row * 4u + 3u] != 0.0;
    let row_words = row * ((p.width + 31u) / 32u);   // the row's first word of `allowed`

    // 1. The first maximum of z over the allowed elements (NaN first; none: NO_INDEX), keeping their bits.
    var value = select(scaled(0u, base, t, sampling), from_bits(0xff800000u), row_masked);
    var index = select(0u, NO_INDEX, row_masked);
    for (var i = lid; i < p.width; i += WG) {
        var bit = 1u;
        if row_masked {   // unmasked rows never read `allowed` (the branch is uniform: one row per workgroup)
            bit = (allowed[row_words + (i >> 5u)] >> (i & 31u)) & 1u;
            let j = i / WG;
            allowed_bits[j >> 5u] |= bit << (j & 31u);
        }
        let v = scaled(i, base, t, sampling);
        if bit != 0u && better(v, i, value, index) { value = v; index = i; }
    }
    draw(lid, item, value, index);
}

// The rest of `sample` from the invocation's first maximum (value, index) of pass 1.
fn draw(lid: u32, item: u32, value: f32, index: u32) {
    let row = min(item, p.rows - 1u);
    let base = row * p.width;
    let t = settings[row * 4u];
    let top_p = settings[row * 4u + 1u];
    let min_p = settings[row * 4u + 2u];
    let k = top_k[row];
    let seed = keys[row * 2u];
    let counter = keys[row * 2u + 1u];
    let sampling = t > 0.0;
    if lid == 0u { k_low = 0u; p_low = 0u; }
    let greedy = tree_best(lid, value, index);
    let none = greedy == NO_INDEX;   // a masked row with no allowed token
    let z_max = select(scaled(min(greedy, p.width - 1u), base, t, sampling), from_bits(0xff800000u), none);
    let random = sampling && is_finite(z_max);
    let key_max = order_key(z_max);
    let k_on = random && k > 0 && u32(k) < p.width;
    let p_on = random && top_p < 1.0;
    let k_passes = select(0u, SEARCH_PASSES, k_on);
    if lid == 0u { search_passes = k_passes + select(0u, SEARCH_PASSES, p_on); }
    let passes = workgroupUniformLoad(&search_passes);   // uniform: the passes' barriers are skipped with them

    // 2. The thresholds, in vLLM's order: top_k's key first (SEARCH_PASSES passes of counts), then top_p's
    // over what top_k and min_p leave (SEARCH_PASSES passes of masses; the target is top_p of that set's
    // mass, summed in its first pass). Each pass settles BIN_BITS bits of the key, from the top; invocation
    // 0 keeps the count or mass above the current interval.
    var k_above = 0u;
    var p_above = 0.0;
    var p_target = 0.0;
    for (var level = 0u; level < passes; level++) {
        let counting = level < k_passes;   // a pass of top_k's search (else of top_p's)
        let shift = (SEARCH_PASSES - 1u - level % SEARCH_PASSES) * BIN_BITS;
        if lid < BINS {
            atomicStore(&key_counts[lid], 0u);
            atomicStore(&mass_low[lid], 0u);
            atomicStore(&mass_high[lid], 0u);
        }
        workgroupBarrier();
        let first = select(p_low, k_low, counting);
        let kept_from = select(0u, min(k_low, key_max), k_on);   // top_k's threshold (settled in its passes)
        var low = array<u32, BINS>();    // explicitly zeroed: wgpu 0.32 (naga) keeps a loop-local var without one
        var high = array<u32, BINS>();
        for (var i = lid; i < p.width; i += WG) {
            let z = visible(i, base, t, sampling);
            let key = order_key(z);
            let b = (key - first) >> shift;
            if key < first || b >= BINS { continue; }
            if counting {
                atomicAdd(&key_counts[b], 1u);
                continue;
            }
            let e = exp(z - z_max);
            if (key >= kept_from && e >= min_p) || key == key_max {   // e in 32.32 fixed point, truncated below
                let whole = u32(e);                                     // 2^-32 (e * 2^32 is exact in f32)
                let fraction = u32((e - f32(whole)) * 4294967296.0);
                low[b] += fraction;
                high[b] += whole + select(0u, 1u, low[b] < fraction);
            }
        }
        for (var b = 0u; b < BINS; b++) {
            if (low[b] | high[b]) != 0u { add_mass(b, high[b], low[b]); }
        }
        workgroupBarrier();
        // invocation 0: the highest bucket whose tail (everything above the interval, then the buckets from
        // the top down to it) reaches the target; none (f32 tails rounded otherwise than in the first pass):
        // bucket 0
        if lid == 0u && counting {
            var tail = 0u;
            var pick = 0u;
            var skip = 0u;
            var found = false;
            for (var j = 0u; j < BINS; j++) {
                let b = BINS - 1u - j;
                let next = tail + atomicLoad(&key_counts[b]);
                if !found && k_above + next >= u32(k) { pick = b; skip = tail; found = true; }
                tail = next;
            }
            if !found { skip = tail - atomicLoad(&key_counts[0]); }
            k_above += skip;
            k_low = first + (pick << shift);
        }
        if lid == 0u && !counting {
            if level == k_passes {
                var total = 0.0;
                for (var b = 0u; b < BINS; b++) { total += mass_of(b); }
                p_target = top_p * total;
            }
            var tail = 0.0;
            var pick = 0u;
            var skip = 0.0;
            var found = false;
            for (var j = 0u; j < BINS; j++) {
                let b = BINS - 1u - j;
                let next = tail + mass_of(b);
                if !found && p_above + next >= p_target { pick = b; skip = tail; found = true; }
                tail = next;
            }
            if !found { skip = tail - mass_of(0u); }
            p_above += skip;
            p_low = first + (pick << shift);
        }
        workgroupBarrier();
    }
    // thresholds above the maximum's key (top_p <= 0) come down to it: the maximum is always allowed
    let k_threshold = select(0u, min(k_low, key_max), k_on);
    let p_threshold = select(0u, min(p_low, key_max), p_on);

    // 3. The first maximum of z + Gumbel noise over the allowed elements.
    var score = z_max + gumbel(seed, counter, greedy);   // the maximum is always allowed
    var chosen = greedy;
    let drawn = select(0u, p.width, random);
    for (var i = lid; i < drawn; i += WG) {
        let z = visible(i, base, t, sampling);
        let key = order_key(z);
        if (key >= k_threshold && key >= p_threshold && exp(z - z_max) >= min_p) || key == key_max {
            let s = z + gumbel(seed, counter, i);
            if s > score || (s == score && i < chosen) { score = s; chosen = i; }
        }
    }
    let picked = tree_best(lid, score, chosen);
    if lid == 0u && item < p.rows { out[item] = O(select(i32(picked), -1, none)); }
}

// logprobs writes O = f32 (the module compiles per launch, with O = i32 for sample).
// The f32 of a bit pattern, a runtime value: a constant NaN or infinity fails shader creation in WGSL.
fn from_bits(bits: u32) -> f32 {
    return bitcast<f32>(bits);
}

// The logprob l - lse, or NaN where the row's maximum is not finite (found by bits: WGSL may fold NaN tests).
fn logprob_of(l: f32, lse: f32, finite: bool) -> f32 {
    return select(from_bits(0x7fc00000u), l - lse, finite);
}

@compute @workgroup_size(WG)
fn logprobs(@builtin(local_invocation_id) local_id: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
            @builtin(num_workgroups) groups: vec3<u32>) {
    let lid = local_id.x;
    let item = wid.x + wid.y * groups.x;
    let row = min(item, p.rows - 1u);
    let base = row * p.width;
    let at = item * LOGPROB_WIDTH;
    let live = item < p.rows;
    let n = top_k[row];
    if lid == 0u { rank_count = select(0u, min(u32(max(n, 0)), min(MAX_TOP, p.width)) + 1u, n >= 0); }
    let ranks = workgroupUniformLoad(&rank_count);   // uniform: a skipped row skips every barrier
    if live && lid == 0u {   // invocation 0 writes the whole row (first NaN, id -1; then what it computes)
        for (var j = 0u; j < LOGPROB_WIDTH; j++) {
            out[at + j] = O(select(from_bits(0x7fc00000u), -1.0, j >= 1u && j <= MAX_TOP));
        }
    }
    if ranks == 0u { return; }

    // 1. The first maximum (the first top id) and 2. the sum of exp(l - m).
    var value = f32(logits[base]);
    var index = 0u;
    for (var i = lid; i < p.width; i += WG) {
        let v = f32(logits[base + i]);
        if better(v, i, value, index) { value = v; index = i; }
    }
    var pick = tree_best(lid, value, index);
    let m = f32(logits[base + pick]);
    let finite = (bitcast<u32>(m) & 0x7f800000u) != 0x7f800000u;
    var total = 0.0;
    for (var i = lid; i < p.width; i += WG) {
        total += exp(f32(logits[base + i]) - m);
    }
    let lse = m + log(tree_sum(lid, total));
    let wanted = ids[row];
    if live && lid == 0u && wanted >= 0 && u32(wanted) < p.width {
        out[at] = O(logprob_of(f32(logits[base + u32(wanted)]), lse, finite));
    }

    // 3. The top ids: rank r is the first element in argmax's order after rank r - 1's.
    for (var rank = 0u; rank + 1u < ranks; rank++) {
        let previous = f32(logits[base + pick]);
        if rank > 0u {
            value = from_bits(0xff800000u);   // (-inf, no index): after every element in argmax's order
            index = 0xffffffffu;
            for (var i = lid; i < p.width; i += WG) {
                let v = f32(logits[base + i]);
                if better(previous, pick, v, i) && better(v, i, value, index) { value = v; index = i; }
            }
            pick = tree_best(lid, value, index);
        }
        if live && lid == 0u {
            out[at + 1u + rank] = O(f32(pick));
            out[at + 1u + MAX_TOP + rank] = O(logprob_of(f32(logits[base + pick]), lse, finite));
        }
    }
}
