// Decoder attention pieces. Positions come from the batch's per-execute scalars (or a literal).
// rope:      rotate-half rotary embedding of x (tokens, heads, head_dim) at positions pos + t.
// kv_write:  cache[pos + t] = new[t] for a (cache_len, kv_heads, head_dim) cache, in place.
// attention: softmax(q . k^T * scale + causal mask) . v over cache rows [0, pos + t], grouped-query
//            heads (head h reads kv head h / (heads / kv_heads)); one workgroup per (token, head),
//            scores kept in workgroup memory (SMAX = cache length: caches up to one block of rows).
// Longer caches, flash-decoding style, over f32 partials (max score, sum of exp, head_dim exp-weighted
// sums of value rows), p.splits of them per (token, head), in order:
// attention_partial: one workgroup per (token, head, block of split_rows = SMAX cache rows); a block past
//            the visible rows (the position is a per-execute scalar) writes (LOWEST, 0, 0...).
// attention_merge:   folds each run of p.fan_in partials into one (while too many for one invocation).
// attention_combine: folds all of a (token, head)'s partials and writes its output.
// Aliases: A (tensor storage type), C (f32).

//!interface

var<workgroup> scores: array<f32, SMAX>;
var<workgroup> q_row: array<f32, HEAD_DIM>;
//!include tree
//!include nan

fn position() -> u32 {
    if p.pos_slot == NO_SLOT { return p.pos_literal; }
    return scalars.values[p.pos_slot / 4u][p.pos_slot % 4u];
}

@compute @workgroup_size(WG)
fn rope(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let half = p.head_dim / 2u;
    let i = gid.x + gid.y * groups.x * WG;
    if i >= p.tokens * p.heads * half { return; }
    let j = i % half;
    let row = i / half;                       // token * heads + head
    let t = row / p.heads;
    let turns = f32(position() + t) * table[j] / TWO_PI;
    let angle = (turns - round(turns)) * TWO_PI;   // reduced to [-pi, pi] where cos/sin are accurate
    let c = cos(angle);
    let s = sin(angle);
    let base = row * p.head_dim;
    let x1 = f32(src[base + j]);
    let x2 = f32(src[base + j + half]);
    dst[base + j] = A(x1 * c - x2 * s);
    dst[base + j + half] = A(x2 * c + x1 * s);
}

@compute @workgroup_size(WG)
fn kv_write(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let row = p.kv_heads * p.head_dim;
    let i = gid.x + gid.y * groups.x * WG;
    if i >= p.tokens * row { return; }
    let target_row = position() + i / row;
    if target_row >= p.cache_len { return; }
    dst[target_row * row + i % row] = src[i];
}

// Rows of the cache token t sees: [0, pos + t] when causal, else [0, pos + tokens).
fn visible_rows(t: u32) -> u32 {
    if p.causal != 0u { return min(position() + t + 1u, p.cache_len); }
    return min(position() + p.tokens, p.cache_len);
}

// Offset of item (token * heads + head)'s kv head within a cache row.
fn kv_offset(item: u32) -> u32 {
    return (item % p.heads) / (p.heads / p.kv_heads) * p.head_dim;
}

// Scores of item's query over cache rows [first, last) (at most SMAX): scores[j - first] =
// exp(score_j - top); returns (top, sum of exp), (LOWEST, 0) for no rows. Every invocation of the
// workgroup calls it in uniform control flow (barriers).
fn softmax_rows(lid: u32, item: u32, first: u32, last: u32) -> vec2<f32> {
    let row = p.kv_heads * p.head_dim;
    let offset = kv_offset(item);
    for (var d = lid; d < p.head_dim; d += WG) {
        q_row[d] = f32(src[item * p.head_dim + d]) * p.scale;
    }
    workgroupBarrier();
    var best = LOWEST;
    for (var j = first + lid; j < last; j += WG) {
        var s = 0.0;
        for (var d = 0u; d < p.head_dim; d++) {
            s += q_row[d] * f32(keys[j * row + offset + d]);
        }
        scores[j - first] = s;
        best = max(best, s);
    }
    let top = tree_max(lid, best);
    var mass = 0.0;
    for (var j = first + lid; j < last; j += WG) {
        let e = exp(scores[j - first] - top);
        scores[j - first] = e;
        mass += e;
    }
    return vec2<f32>(top, tree_sum(lid, mass));
}

// Sum over cache rows [first, last) of scores[j - first] * v[j][d] for item's kv head.
fn weighted_values(item: u32, first: u32, last: u32, d: u32) -> f32 {
    let row = p.kv_heads * p.head_dim;
    let column = kv_offset(item) + d;
    var acc = 0.0;
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
    let stats = softmax_rows(lid.x, it, 0u, count);
    if !valid { return; }
    for (var d = lid.x; d < p.head_dim; d += WG) {
        dst[it * p.head_dim + d] = A(weighted_values(it, 0u, count, d) / stats.y);
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
    let first = (b % p.splits) * p.split_rows;
    let last = clamp(visible_rows(it / p.heads), first, first + p.split_rows);
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
