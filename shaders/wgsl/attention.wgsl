// Decoder attention pieces. Positions come from the batch's per-execute scalars (or a literal).
// rope:      rotate-half rotary embedding of x (tokens, heads, head_dim) at positions pos + t;
// rope_positions: the same at positions indices[t] (an int32 tensor).
// kv_write:  cache[pos + t] = new[t] for a (cache_len, kv_heads, head_dim) cache, in place;
// rope_kv_write: rope of the q and k heads of a fused (tokens, heads + 2 kv_heads, head_dim) projection,
//            q into dst, k and v into the caches keys_out / values_out at rows pos + t, in place;
// rope_kv_scatter: the same at positions indices[t], into rows rows[t] (a paged pool);
// scatter_rows: dst[indices[i]] = src[i] for rows of kv_heads * head_dim elements, rows outside
//            [0, cache_len) skipped, in place.
// attention: softmax(q . k^T * scale + causal mask) . v over cache rows [0, pos + t] (with a sliding
//            window, p.window > 0: rows (pos + t - window, pos + t]), grouped-query
//            heads (head h reads kv head h / (heads / kv_heads)); one workgroup per (token, head),
//            scores kept in workgroup memory (SMAX = cache length: caches up to one block of rows).
// Longer caches, flash-decoding style, over f32 partials (max score, sum of exp, head_dim exp-weighted
// sums of value rows), p.splits of them per (token, head), in order:
// attention_partial: one workgroup per (token, head, block of split_rows = SMAX cache rows); a block past
//            the visible rows (the position is a per-execute scalar) writes (LOWEST, 0, 0...).
// attention_merge:   folds each run of p.fan_in partials into one (while too many for one invocation).
// attention_combine: folds all of a (token, head)'s partials and writes its output.
// paged_attention / paged_attention_partial: attention and attention_partial for query rows n over
// the positions of a paged KV pool (see "Paged attention" below); merge and combine are shared.
// Aliases: A (tensor storage type: x, q, output, caches written), B (keys and values read), C, H (f32; f16 in
// the half form, HALF: a launch's Launch.for_half, where key_score and weighted_values multiply in f16 and sum
// in f32).

//!interface

var<workgroup> scores: array<f32, SMAX>;
var<workgroup> q_row: array<f32, HEAD_DIM>;
//!include tree
//!include nan

fn position() -> u32 {
    if p.pos_slot == NO_SLOT { return p.pos_literal; }
    return scalars.values[p.pos_slot / 4u][p.pos_slot % 4u];
}

// The rope pair of invocation gid: (row = token * heads + head, j < head_dim / 2, 1), or (0, 0, 0) past
// the last pair.
fn rope_pair(gid: vec3<u32>, groups: vec3<u32>) -> vec3<u32> {
    let half = p.head_dim / 2u;
    let i = gid.x + gid.y * groups.x * WG;
    if i >= p.tokens * p.heads * half { return vec3<u32>(0u, 0u, 0u); }
    return vec3<u32>(i / half, i % half, 1u);
}

// Rotates the pair (j, j + half) of row `row` (token * heads + head) of x by position `at`.
fn rotate(row: u32, j: u32, at: f32) {
    let half = p.head_dim / 2u;
    let base = row * p.head_dim;
    let r = rotated(f32(src[base + j]), f32(src[base + j + half]), rotation(j, at));
    dst[base + j] = A(r.x);
    dst[base + j + half] = A(r.y);
}

@compute @workgroup_size(WG)
fn rope(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let pair = rope_pair(gid, groups);
    if pair.z == 0u { return; }
    rotate(pair.x, pair.y, f32(position() + pair.x / p.heads));
}

@compute @workgroup_size(WG)
fn rope_positions(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let pair = rope_pair(gid, groups);
    if pair.z == 0u { return; }
    rotate(pair.x, pair.y, f32(indices[pair.x / p.heads]));
}

// cos and sin of the rotation of pair j at position `at`: the f32 angle at * inv_freq (as transformers
// computes it), reduced to [-pi, pi] by whole turns with 2 pi in two parts (Cody-Waite), where the
// drivers' cos/sin are accurate.
fn rotation(j: u32, at: f32) -> vec2<f32> {
    let angle = at * table[j];
    let turns = round(angle / TWO_PI);
    let reduced = (angle - turns * TWO_PI_HI) - turns * TWO_PI_LO;
    return vec2<f32>(cos(reduced), sin(reduced));
}

// The pair (x1, x2) rotated by cs = (cos, sin): (x1 c - x2 s, x2 c + x1 s), for every rope form. WGSL lets
// an implementation fuse a product with the sum (and reassociate), so unlike the CUDA twin (each rounding
// spelled out) two kernels may round a rotation differently: the forms agree within a few ulps here.
fn rotated(x1: f32, x2: f32, cs: vec2<f32>) -> vec2<f32> {
    return vec2<f32>(x1 * cs.x - x2 * cs.y, x2 * cs.x + x1 * cs.y);
}

// rope_kv_write / rope_kv_scatter: src is a fused projection (tokens, heads + 2 kv_heads, head_dim): q heads,
// then k, then v. One invocation per (token, head of src, pair j): a q head's pair is rotated into dst
// (tokens, heads, head_dim); a k head's pair is rotated into row `cache_row` of keys_out, a v head's copied
// into that row of values_out (rows past cache_len skipped). rope_kv_write: token t at position pos + t,
// written at row pos + t; rope_kv_scatter: at position indices[t], written at row rows[t] (negative:
// skipped).
// The rotation / copy of src element pair j of `row` (token * width + head of src) at position `at`,
// into cache row `cache_row` for k and v heads.
fn rope_kv(row: u32, j: u32, at: f32, cache_row: u32) {
    let half = p.head_dim / 2u;
    let token = row / (p.heads + 2u * p.kv_heads);
    let head = row % (p.heads + 2u * p.kv_heads);
    let base = row * p.head_dim;
    let x1 = f32(src[base + j]);
    let x2 = f32(src[base + j + half]);
    if head >= p.heads + p.kv_heads {           // v: copied
        if cache_row >= p.cache_len { return; }
        let out = (cache_row * p.kv_heads + head - p.heads - p.kv_heads) * p.head_dim;
        values_out[out + j] = B(x1);
        values_out[out + j + half] = B(x2);
        return;
    }
    let r = rotated(x1, x2, rotation(j, at));
    if head < p.heads {                          // q
        let out = (token * p.heads + head) * p.head_dim;
        dst[out + j] = A(r.x);
        dst[out + j + half] = A(r.y);
    } else if cache_row < p.cache_len {          // k
        let out = (cache_row * p.kv_heads + head - p.heads) * p.head_dim;
        keys_out[out + j] = B(r.x);
        keys_out[out + j + half] = B(r.y);
    }
}

// (row of src, pair j, 1) of invocation gid, or (0, 0, 0) past the last pair.
fn rope_kv_pair(gid: vec3<u32>, groups: vec3<u32>) -> vec3<u32> {
    let half = p.head_dim / 2u;
    let i = gid.x + gid.y * groups.x * WG;
    if i >= p.tokens * (p.heads + 2u * p.kv_heads) * half { return vec3<u32>(0u, 0u, 0u); }
    return vec3<u32>(i / half, i % half, 1u);
}

@compute @workgroup_size(WG)
fn rope_kv_write(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let pair = rope_kv_pair(gid, groups);
    if pair.z == 0u { return; }
    let cache_row = position() + pair.x / (p.heads + 2u * p.kv_heads);
    rope_kv(pair.x, pair.y, f32(cache_row), cache_row);
}

@compute @workgroup_size(WG)
fn rope_kv_scatter(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let pair = rope_kv_pair(gid, groups);
    if pair.z == 0u { return; }
    let token = pair.x / (p.heads + 2u * p.kv_heads);
    // a negative row converts to at least 2^31, past any cache (cache_len < 2^31): skipped
    rope_kv(pair.x, pair.y, f32(indices[token]), u32(rows[token]));
}

// Element i of src's rows (kv_heads * head_dim each) into row `target_row` of dst; skipped past cache_len.
fn write_row_element(i: u32, target_row: u32) {
    let row = p.kv_heads * p.head_dim;
    if target_row >= p.cache_len { return; }
    dst[target_row * row + i % row] = src[i];
}

@compute @workgroup_size(WG)
fn kv_write(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = gid.x + gid.y * groups.x * WG;
    if i >= p.tokens * p.kv_heads * p.head_dim { return; }
    write_row_element(i, position() + i / (p.kv_heads * p.head_dim));
}

@compute @workgroup_size(WG)
fn scatter_rows(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = gid.x + gid.y * groups.x * WG;
    if i >= p.tokens * p.kv_heads * p.head_dim { return; }
    // a negative target converts to at least 2^31, past any table (cache_len < 2^31): skipped
    write_row_element(i, u32(indices[i / (p.kv_heads * p.head_dim)]));
}

// Rows of the cache token t sees: [0, pos + t] when causal, else [0, pos + tokens).
fn visible_rows(t: u32) -> u32 {
    if p.causal != 0u { return min(position() + t + 1u, p.cache_len); }
    return min(position() + p.tokens, p.cache_len);
}

// The first row (position) a query seeing up to `end` (exclusive) sees: end - window with a sliding window
// (p.window > 0, causal), else 0.
fn window_start(end: u32) -> u32 {
    if p.window == 0u || end <= p.window { return 0u; }
    return end - p.window;
}

// Offset of item (token * heads + head)'s kv head within a cache row.
fn kv_offset(item: u32) -> u32 {
    return (item % p.heads) / (p.heads / p.kv_heads) * p.head_dim;
}

// q_row = item's query row times the scale. Every invocation of the workgroup calls it (a barrier).
fn load_query(lid: u32, item: u32) {
    for (var d = lid; d < p.head_dim; d += WG) {
        q_row[d] = f32(src[item * p.head_dim + d]) * p.scale;
    }
    workgroupBarrier();
}

// q_row . the key of cache (pool) row r at kv-head offset `offset`. The half form: four elements at a time
// dotted in f16, summed in f32.
fn key_score(r: u32, offset: u32) -> f32 {
    let base = r * p.kv_heads * p.head_dim + offset;
    var s = 0.0;
    if HALF {
        var d = 0u;
        for (; d + 4u <= p.head_dim; d += 4u) {
            let q = vec4<H>(H(q_row[d]), H(q_row[d + 1u]), H(q_row[d + 2u]), H(q_row[d + 3u]));
            let k = vec4<H>(H(keys[base + d]), H(keys[base + d + 1u]), H(keys[base + d + 2u]), H(keys[base + d + 3u]));
            s += f32(dot(q, k));
        }
        for (; d < p.head_dim; d++) {
            s += f32(H(q_row[d]) * H(keys[base + d]));
        }
        return s;
    }
    for (var d = 0u; d < p.head_dim; d++) {
        s += q_row[d] * f32(keys[base + d]);
    }
    return s;
}

// scores[j - first] = exp(score_j - top) over [first, last), each invocation's scores and their maximum
// `best` given; returns (top, sum of exp). Every invocation of the workgroup calls it (barriers).
fn normalize_scores(lid: u32, first: u32, last: u32, best: f32) -> vec2<f32> {
    let top = tree_max(lid, best);
    var mass = 0.0;
    for (var j = first + lid; j < last; j += WG) {
        let e = exp(scores[j - first] - top);
        scores[j - first] = e;
        mass += e;
    }
    return vec2<f32>(top, tree_sum(lid, mass));
}

// Scores of item's query over cache rows [first, last) (at most SMAX): scores[j - first] =
// exp(score_j - top); returns (top, sum of exp), (LOWEST, 0) for no rows. Every invocation of the
// workgroup calls it in uniform control flow (barriers).
fn softmax_rows(lid: u32, item: u32, first: u32, last: u32) -> vec2<f32> {
    load_query(lid, item);
    let offset = kv_offset(item);
    var best = LOWEST;
    for (var j = first + lid; j < last; j += WG) {
        let s = key_score(j, offset);
        scores[j - first] = s;
        best = max(best, s);
    }
    return normalize_scores(lid, first, last, best);
}

// Sum over cache rows [first, last) of scores[j - first] * v[j][d] for item's kv head (the half form: each
// product in f16, the sum in f32).
fn weighted_values(item: u32, first: u32, last: u32, d: u32) -> f32 {
    let row = p.kv_heads * p.head_dim;
    let column = kv_offset(item) + d;
    var acc = 0.0;
    if HALF {
        for (var j = first; j < last; j++) {
            acc += f32(H(scores[j - first]) * H(values[j * row + column]));
        }
        return acc;
    }
    for (var j = first; j < last; j++) {
        acc += scores[j - first] * f32(values[j * row + column]);
    }
    return acc;
}

@compute @workgroup_size(WG)
fn attention(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
             @builtin(num_workgroups) groups: vec3<u32>) {
    let item = wid.x + wid.y * groups.x;      // token * heads + head
    let valid = item < p.tokens * p.heads;
    let it = min(item, p.tokens * p.heads - 1u);
    let count = visible_rows(it / p.heads);
    let start = window_start(count);
    let stats = softmax_rows(lid.x, it, start, count);
    if !valid { return; }
    for (var d = lid.x; d < p.head_dim; d += WG) {
        dst[it * p.head_dim + d] = A(weighted_values(it, start, count, d) / stats.y);
    }
}

@compute @workgroup_size(WG)
fn attention_partial(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
                     @builtin(num_workgroups) groups: vec3<u32>) {
    let blocks = p.tokens * p.heads * p.splits;
    let block = wid.x + wid.y * groups.x;     // (token * heads + head) * splits + split
    let valid = block < blocks;
    let b = min(block, blocks - 1u);
    let it = b / p.splits;
    let visible = visible_rows(it / p.heads);
    let last = clamp(visible, (b % p.splits) * p.split_rows, (b % p.splits + 1u) * p.split_rows);
    let first = clamp(window_start(visible), (b % p.splits) * p.split_rows, last);
    let stats = softmax_rows(lid.x, it, first, last);
    if !valid { return; }
    let base = b * (p.head_dim + PARTIAL_HEADER);
    if lid.x == 0u {
        partials_out[base] = stats.x;
        partials_out[base + 1u] = stats.y;
    }
    for (var d = lid.x; d < p.head_dim; d += WG) {
        partials_out[base + PARTIAL_HEADER + d] = weighted_values(it, first, last, d);
    }
}

// Folds of partials_in [first, last) (indices of partials): the largest max, the sum of the sums and
// the weighted sums at d, each partial rescaled by exp(its max - top).
fn folded_max(first: u32, last: u32) -> f32 {
    var top = LOWEST;
    for (var s = first; s < last; s++) {
        top = max(top, partials_in[s * (p.head_dim + PARTIAL_HEADER)]);
    }
    return top;
}

fn folded_sum(first: u32, last: u32, top: f32) -> f32 {
    var total = 0.0;
    for (var s = first; s < last; s++) {
        let base = s * (p.head_dim + PARTIAL_HEADER);
        total += exp(partials_in[base] - top) * partials_in[base + 1u];
    }
    return total;
}

fn folded_values(first: u32, last: u32, top: f32, d: u32) -> f32 {
    var acc = 0.0;
    for (var s = first; s < last; s++) {
        let base = s * (p.head_dim + PARTIAL_HEADER);
        acc += exp(partials_in[base] - top) * partials_in[base + PARTIAL_HEADER + d];
    }
    return acc;
}

@compute @workgroup_size(WG)
fn attention_merge(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
                   @builtin(num_workgroups) groups: vec3<u32>) {
    let folded = (p.splits + p.fan_in - 1u) / p.fan_in;   // partials per (token, head) after this pass
    let fold = wid.x + wid.y * groups.x;      // (token * heads + head) * folded + fold of this workgroup
    if fold >= p.tokens * p.heads * folded { return; }
    let it = fold / folded;
    let first = it * p.splits + (fold % folded) * p.fan_in;
    let last = min(first + p.fan_in, (it + 1u) * p.splits);
    let top = folded_max(first, last);
    let base = fold * (p.head_dim + PARTIAL_HEADER);
    if lid.x == 0u {
        partials_out[base] = top;
        partials_out[base + 1u] = folded_sum(first, last, top);
    }
    for (var d = lid.x; d < p.head_dim; d += WG) {
        partials_out[base + PARTIAL_HEADER + d] = folded_values(first, last, top, d);
    }
}

@compute @workgroup_size(WG)
fn attention_combine(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
                     @builtin(num_workgroups) groups: vec3<u32>) {
    let it = wid.x + wid.y * groups.x;        // token * heads + head
    if it >= p.tokens * p.heads { return; }
    let first = it * p.splits;
    let last = first + p.splits;
    let top = folded_max(first, last);
    let total = folded_sum(first, last, top);
    for (var d = lid.x; d < p.head_dim; d += WG) {
        dst[it * p.head_dim + d] = A(folded_values(first, last, top, d) / total);
    }
}

// Paged attention. Query row n (item = n * heads + head) of sequence indices[n] attends over positions
// [0, lengths[n]) (clamped to max_blocks * block_size; with a window, its last p.window of them); position j lives in pool row
// block_tables[seq * max_blocks + j / block_size] * block_size + j % block_size of keys / values
// (cache_len rows). A position whose block is not in the pool scores LOWEST and its value row is never
// read: next to any position in the pool its weight exp(LOWEST - top) is 0, and a row whose positions
// are all outside the pool sums zeros. A row with no positions (idle: length <= 0, or its sequence
// outside the block table's rows) writes zeros: its total is set to 1 over zero weighted sums.

// (positions query row n attends over, the offset of its sequence's block-table row).
fn paged_span(n: u32) -> vec2<u32> {
    let seq = indices[n];
    if seq < 0 || u32(seq) >= p.sequences { return vec2<u32>(0u, 0u); }
    let count = u32(clamp(lengths[n], 0, i32(p.max_blocks * p.block_size)));   // max_blocks * block_size < 2^31
    return vec2<u32>(count, u32(seq) * p.max_blocks);
}

// Pool row of position j of the sequence whose block-table row starts at `table_row`; NO_ROW when its
// block is not in the pool.
fn pool_row(table_row: u32, j: u32) -> u32 {
    let block = block_tables[table_row + j / p.block_size];
    let blocks = (p.cache_len + p.block_size - 1u) / p.block_size;   // the last one may be partial
    if block < 0 || u32(block) >= blocks { return NO_ROW; }
    let r = u32(block) * p.block_size + j % p.block_size;
    return select(NO_ROW, r, r < p.cache_len);
}

// softmax_rows over positions [first, last) of the sequence at `table_row`.
fn paged_softmax(lid: u32, item: u32, table_row: u32, first: u32, last: u32) -> vec2<f32> {
    load_query(lid, item);
    let offset = kv_offset(item);
    var best = LOWEST;
    for (var j = first + lid; j < last; j += WG) {
        let r = pool_row(table_row, j);
        var s = LOWEST;
        if r != NO_ROW { s = key_score(r, offset); }
        scores[j - first] = s;
        best = max(best, s);
    }
    return normalize_scores(lid, first, last, best);
}

// weighted_values over positions [first, last) of the sequence at `table_row`.
fn paged_weighted_values(item: u32, table_row: u32, first: u32, last: u32, d: u32) -> f32 {
    let row = p.kv_heads * p.head_dim;
    let column = kv_offset(item) + d;
    var acc = 0.0;
    for (var j = first; j < last; j++) {
        let r = pool_row(table_row, j);
        if r != NO_ROW { acc += scores[j - first] * f32(values[r * row + column]); }
    }
    return acc;
}

@compute @workgroup_size(WG)
fn paged_attention(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
                   @builtin(num_workgroups) groups: vec3<u32>) {
    let item = wid.x + wid.y * groups.x;      // n * heads + head
    let valid = item < p.tokens * p.heads;
    let it = min(item, p.tokens * p.heads - 1u);
    let span = paged_span(it / p.heads);
    let start = window_start(span.x);
    let stats = paged_softmax(lid.x, it, span.y, start, span.x);
    if !valid { return; }
    let total = select(stats.y, 1.0, span.x == 0u);
    for (var d = lid.x; d < p.head_dim; d += WG) {
        dst[it * p.head_dim + d] = A(paged_weighted_values(it, span.y, start, span.x, d) / total);
    }
}

@compute @workgroup_size(WG)
fn paged_attention_partial(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
                           @builtin(num_workgroups) groups: vec3<u32>) {
    let blocks = p.tokens * p.heads * p.splits;
    let block = wid.x + wid.y * groups.x;     // (n * heads + head) * splits + split
    let valid = block < blocks;
    let b = min(block, blocks - 1u);
    let it = b / p.splits;
    let span = paged_span(it / p.heads);
    let last = clamp(span.x, (b % p.splits) * p.split_rows, (b % p.splits + 1u) * p.split_rows);
    let first = clamp(window_start(span.x), (b % p.splits) * p.split_rows, last);
    let stats = paged_softmax(lid.x, it, span.y, first, last);
    if !valid { return; }
    let base = b * (p.head_dim + PARTIAL_HEADER);
    if lid.x == 0u {
        partials_out[base] = stats.x;
        partials_out[base + 1u] = select(stats.y, 1.0, span.x == 0u);
    }
    for (var d = lid.x; d < p.head_dim; d += WG) {
        partials_out[base + PARTIAL_HEADER + d] = paged_weighted_values(it, span.y, first, last, d);
    }
}
