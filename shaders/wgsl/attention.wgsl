// Decoder attention pieces. Positions come from the batch's per-execute scalars (or a literal).
// rope:      rotate-half rotary embedding of x (tokens, heads, head_dim) at positions pos + t.
// kv_write:  cache[pos + t] = new[t] for a (cache_len, kv_heads, head_dim) cache, in place.
// attention: softmax(q . k^T * scale + causal mask) . v over cache rows [0, pos + t], grouped-query
//            heads (head h reads kv head h / (heads / kv_heads)); one workgroup per (token, head),
//            scores kept in workgroup memory (SMAX = cache length).
// Aliases: A (tensor storage type), C (f32).

override WG: u32 = 64u;
override SMAX: u32 = 1u;
override HEAD_DIM: u32 = 1u;
const NO_SLOT: u32 = 0xFFFFFFFFu;
const TWO_PI: f32 = 6.283185307179586;

struct Params {
    tokens: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    cache_len: u32,
    pos_slot: u32,
    pos_literal: u32,
    causal: u32,
    scale: f32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
}

struct Scalars {
    values: array<vec4<u32>, 16>,
}

@group(0) @binding(0) var<storage, read> src: array<A>;          // rope x, kv_write new, attention q
@group(0) @binding(1) var<storage, read> table: array<f32>;      // rope inverse frequencies
@group(0) @binding(2) var<storage, read> keys: array<A>;
@group(0) @binding(3) var<storage, read> values: array<A>;
@group(0) @binding(4) var<storage, read_write> dst: array<A>;    // rope/attention output, kv cache
@group(0) @binding(5) var<uniform> p: Params;
@group(0) @binding(6) var<uniform> scalars: Scalars;

var<workgroup> scores: array<f32, SMAX>;
var<workgroup> q_row: array<f32, HEAD_DIM>;
//!include tree

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

@compute @workgroup_size(WG)
fn attention(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
             @builtin(num_workgroups) groups: vec3<u32>) {
    let item = wid.x + wid.y * groups.x;      // token * heads + head
    let valid = item < p.tokens * p.heads;
    let it = min(item, p.tokens * p.heads - 1u);
    let t = it / p.heads;
    let kv_head = (it % p.heads) / (p.heads / p.kv_heads);
    let start = position();
    var count = min(start + p.tokens, p.cache_len);
    if p.causal != 0u { count = min(start + t + 1u, p.cache_len); }
    let row = p.kv_heads * p.head_dim;
    let head_offset = kv_head * p.head_dim;

    for (var d = lid.x; d < p.head_dim; d += WG) {
        q_row[d] = f32(src[it * p.head_dim + d]) * p.scale;
    }
    workgroupBarrier();
    var best = -3.4028234e38;
    for (var j = lid.x; j < count; j += WG) {
        var s = 0.0;
        for (var d = 0u; d < p.head_dim; d++) {
            s += q_row[d] * f32(keys[j * row + head_offset + d]);
        }
        scores[j] = s;
        best = max(best, s);
    }
    let top = tree_max(lid.x, best);
    var mass = 0.0;
    for (var j = lid.x; j < count; j += WG) {
        let e = exp(scores[j] - top);
        scores[j] = e;
        mass += e;
    }
    let total = tree_sum(lid.x, mass);
    if !valid { return; }
    for (var d = lid.x; d < p.head_dim; d += WG) {
        var acc = 0.0;
        for (var j = 0u; j < count; j++) {
            acc += scores[j] * f32(values[j * row + head_offset + d]);
        }
        dst[it * p.head_dim + d] = A(acc / total);
    }
}
