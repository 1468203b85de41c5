// Row normalizations, one workgroup per row, sums in f32 through a tree in workgroup memory.
// rms_norm_rows:      out = x * rsqrt(mean(x^2) + eps) * w
// add_rms_norm_rows:  h = x + residual (written to `summed`), out = rms_norm(h) * w
// layer_norm_rows:    out = (x - mean) * rsqrt(var + eps) * w + b
// Aliases: A (storage type of every tensor), C (f32).

override WG: u32 = 256u;

struct Params {
    rows: u32,
    d: u32,
    eps: f32,
    pad: u32,
}

@group(0) @binding(0) var<storage, read> x: array<A>;
@group(0) @binding(1) var<storage, read> w: array<A>;
@group(0) @binding(2) var<storage, read> extra: array<A>;   // layer_norm bias, or the residual
@group(0) @binding(3) var<storage, read_write> out: array<A>;
@group(0) @binding(4) var<storage, read_write> summed: array<A>;
@group(0) @binding(5) var<uniform> p: Params;

//!include tree

fn row_of(wid: vec3<u32>, groups: vec3<u32>) -> u32 {
    return wid.x + wid.y * groups.x;
}

@compute @workgroup_size(WG)
fn rms_norm_rows(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
                 @builtin(num_workgroups) groups: vec3<u32>) {
    let row = row_of(wid, groups);
    let base = min(row, p.rows - 1u) * p.d;
    var squares = 0.0;
    for (var k = lid.x; k < p.d; k += WG) {
        let v = f32(x[base + k]);
        squares += v * v;
    }
    let scale = inverseSqrt(tree_sum(lid.x, squares) / f32(p.d) + p.eps);
    if row >= p.rows { return; }
    for (var k = lid.x; k < p.d; k += WG) {
        out[base + k] = A(f32(x[base + k]) * scale * f32(w[k]));
    }
}

@compute @workgroup_size(WG)
fn add_rms_norm_rows(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
                     @builtin(num_workgroups) groups: vec3<u32>) {
    let row = row_of(wid, groups);
    let valid = row < p.rows;
    let base = min(row, p.rows - 1u) * p.d;
    var squares = 0.0;
    for (var k = lid.x; k < p.d; k += WG) {
        let v = f32(x[base + k]) + f32(extra[base + k]);
        squares += v * v;
        if valid { summed[base + k] = A(v); }
    }
    let scale = inverseSqrt(tree_sum(lid.x, squares) / f32(p.d) + p.eps);
    if !valid { return; }
    for (var k = lid.x; k < p.d; k += WG) {
        let v = f32(x[base + k]) + f32(extra[base + k]);
        out[base + k] = A(v * scale * f32(w[k]));
    }
}

@compute @workgroup_size(WG)
fn layer_norm_rows(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
                   @builtin(num_workgroups) groups: vec3<u32>) {
    let row = row_of(wid, groups);
    let base = min(row, p.rows - 1u) * p.d;
    var total = 0.0;
    for (var k = lid.x; k < p.d; k += WG) { total += f32(x[base + k]); }
    let mean = tree_sum(lid.x, total) / f32(p.d);
    var deviations = 0.0;
    for (var k = lid.x; k < p.d; k += WG) {
        let c = f32(x[base + k]) - mean;
        deviations += c * c;
    }
    let scale = inverseSqrt(tree_sum(lid.x, deviations) / f32(p.d) + p.eps);
    if row >= p.rows { return; }
    for (var k = lid.x; k < p.d; k += WG) {
        out[base + k] = A((f32(x[base + k]) - mean) * scale * f32(w[k]) + f32(extra[k]));
    }
}
