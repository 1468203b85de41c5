// Reductions over the middle extent of an (outer, r, inner) view. OP_SUM sums, OP_MAX takes the max (NaN
// propagating like numpy's for float data, IS_FLOAT: lib/nan.wgsl); MEAN scales the sum by 1/r.
// Aliases: A (input), O (output), C (accumulator type).
// reduce_rows (inner == 1): one workgroup per chunk of a row (rows longer than `chunk` are cut into
// `chunks` pieces whose partial results a second pass combines), strided partials, then a tree in
// workgroup memory. Output index = row * chunks + chunk index.
// reduce_cols (inner > 1): one thread per output walks r with stride inner.

//!interface

var<workgroup> partial: array<C, WG>;

//!include nan

fn combine(x: C, y: C) -> C {
    if OP == OP_MAX { return max_nan(x, y); }
    return x + y;
}

fn start(first: u32) -> C {
    // max starts from the row's first element (always present); sum from zero.
    if OP == OP_MAX { return C(a[first]); }
    return C(0);
}

fn finish(x: C) -> O {
    if MEAN { return O(f32(x) * p.scale); }
    return O(x);
}

@compute @workgroup_size(WG)
fn reduce_rows(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
               @builtin(num_workgroups) groups: vec3<u32>) {
    let item = wid.x + wid.y * groups.x;
    let valid = item < p.outer * p.chunks;
    let clamped = min(item, p.outer * p.chunks - 1u);
    let piece = clamped % p.chunks;
    let base = (clamped / p.chunks) * p.r + piece * p.chunk;
    let count = min(p.chunk, p.r - piece * p.chunk);
    var acc = start(base);
    for (var k = lid.x; k < count; k += WG) {
        acc = combine(acc, C(a[base + k]));
    }
    partial[lid.x] = acc;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        if lid.x < stride {
            partial[lid.x] = combine(partial[lid.x], partial[lid.x + stride]);
        }
        workgroupBarrier();
    }
    if lid.x == 0u && valid {
        out[item] = finish(partial[0]);
    }
}

@compute @workgroup_size(WG)
fn reduce_cols(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = gid.x + gid.y * groups.x * WG;
    if i >= p.outer * p.inner { return; }
    let base = (i / p.inner) * p.r * p.inner + i % p.inner;
    var acc = start(base);
    for (var k = 0u; k < p.r; k++) {
        acc = combine(acc, C(a[base + k * p.inner]));
    }
    out[i] = finish(acc);
}
