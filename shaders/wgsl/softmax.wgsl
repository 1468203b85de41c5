// Numerically stable softmax over the middle extent of an (outer, r, inner) view:
// exp(x - max) / sum(exp(x - max)), computed in f32. Aliases: A (input), O (output), C (f32 here).
// softmax_rows (inner == 1): one workgroup per row with tree reductions in workgroup memory.
// softmax_cols (inner > 1): one thread per (outer, inner) column.

override WG: u32 = 256u;

struct Params {
    outer: u32,
    r: u32,
    inner: u32,
    scale: f32,
    chunk: u32,
    chunks: u32,
    pad0: u32,
    pad1: u32,
}

@group(0) @binding(0) var<storage, read> a: array<A>;
@group(0) @binding(1) var<storage, read_write> out: array<O>;
@group(0) @binding(2) var<uniform> p: Params;

//!include tree

@compute @workgroup_size(WG)
fn softmax_rows(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
                @builtin(num_workgroups) groups: vec3<u32>) {
    let row = wid.x + wid.y * groups.x;
    let valid = row < p.outer;
    let base = min(row, p.outer - 1u) * p.r;
    var m = f32(a[base]);
    for (var k = lid.x; k < p.r; k += WG) { m = max(m, f32(a[base + k])); }
    let row_max = tree_max(lid.x, m);
    var s = 0.0;
    for (var k = lid.x; k < p.r; k += WG) { s += exp(f32(a[base + k]) - row_max); }
    let total = tree_sum(lid.x, s);
    if !valid { return; }
    for (var k = lid.x; k < p.r; k += WG) {
        out[base + k] = O(exp(f32(a[base + k]) - row_max) / total);
    }
}

@compute @workgroup_size(WG)
fn softmax_cols(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = gid.x + gid.y * groups.x * WG;
    if i >= p.outer * p.inner { return; }
    let base = (i / p.inner) * p.r * p.inner + i % p.inner;
    var m = f32(a[base]);
    for (var k = 0u; k < p.r; k++) { m = max(m, f32(a[base + k * p.inner])); }
    var s = 0.0;
    for (var k = 0u; k < p.r; k++) { s += exp(f32(a[base + k * p.inner]) - m); }
    for (var k = 0u; k < p.r; k++) {
        out[base + k * p.inner] = O(exp(f32(a[base + k * p.inner]) - m) / s);
    }
}
