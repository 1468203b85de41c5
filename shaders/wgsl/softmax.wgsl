// Numerically stable softmax over the middle extent of an (outer, r, inner) view:
// exp(x - max) / sum(exp(x - max)), computed in f32. Aliases: A (input), O (output), C (f32 here).
// The max propagates NaN (lib/nan.wgsl), so a row holding NaN is all NaN, as numpy's.
// softmax_rows (inner == 1, rows of at most one chunk): one workgroup per row with tree reductions in
// workgroup memory.
// Longer rows, in p.chunks pieces of p.chunk elements, one workgroup per (row, piece) in two passes:
// softmax_partials writes each piece's (max, sum of exp(x - max)) to `partials`; softmax_chunks combines
// the row's partials as online softmax does and writes its piece.
// softmax_cols (inner > 1): one thread per (outer, inner) column.

//!interface

//!include tree
//!include nan

@compute @workgroup_size(WG)
fn softmax_rows(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
                @builtin(num_workgroups) groups: vec3<u32>) {
    let row = wid.x + wid.y * groups.x;
    let valid = row < p.outer;
    let base = min(row, p.outer - 1u) * p.r;
    var m = f32(a[base]);
    for (var k = lid.x; k < p.r; k += WG) { m = max_nan_f32(m, f32(a[base + k])); }
    let row_max = tree_max(lid.x, m);
    var s = 0.0;
    for (var k = lid.x; k < p.r; k += WG) { s += exp(f32(a[base + k]) - row_max); }
    let total = tree_sum(lid.x, s);
    if !valid { return; }
    for (var k = lid.x; k < p.r; k += WG) {
        out[base + k] = O(exp(f32(a[base + k]) - row_max) / total);
    }
}

//!include pieces

fn piece_of(wid: vec3<u32>, groups: vec3<u32>) -> Piece {
    return piece_at(wid.x + wid.y * groups.x, p.outer, p.r, p.chunk);
}

@compute @workgroup_size(WG)
fn softmax_partials(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
                    @builtin(num_workgroups) groups: vec3<u32>) {
    let piece = piece_of(wid, groups);
    let base = piece.row * p.r + piece.first;
    var m = f32(a[base]);
    for (var k = lid.x; k < piece.count; k += WG) { m = max_nan_f32(m, f32(a[base + k])); }
    let piece_max = tree_max(lid.x, m);
    var s = 0.0;
    for (var k = lid.x; k < piece.count; k += WG) { s += exp(f32(a[base + k]) - piece_max); }
    let piece_sum = tree_sum(lid.x, s);
    if lid.x == 0u && piece.valid {
        partials[2u * piece.index] = piece_max;
        partials[2u * piece.index + 1u] = piece_sum;
    }
}

// (max, sum of exp(x - max)) of the piece's row from its pieces' partials. A piece of -inf only (its sum
// is NaN) adds nothing.
fn row_max_and_sum(lid: u32, piece: Piece) -> vec2<f32> {
    let first = piece.row * p.chunks;
    var m = partials[2u * first];
    for (var j = lid; j < p.chunks; j += WG) { m = max_nan_f32(m, partials[2u * (first + j)]); }
    let row_max = tree_max(lid, m);
    var s = 0.0;
    for (var j = lid; j < p.chunks; j += WG) {
        let piece_max = partials[2u * (first + j)];
        if !(piece_max < -3.4028234e38) { s += partials[2u * (first + j) + 1u] * exp(piece_max - row_max); }
    }
    return vec2(row_max, tree_sum(lid, s));
}

@compute @workgroup_size(WG)
fn softmax_chunks(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
                  @builtin(num_workgroups) groups: vec3<u32>) {
    let piece = piece_of(wid, groups);
    let row_stats = row_max_and_sum(lid.x, piece);
    if !piece.valid { return; }
    let base = piece.row * p.r + piece.first;
    for (var k = lid.x; k < piece.count; k += WG) {
        out[base + k] = O(exp(f32(a[base + k]) - row_stats.x) / row_stats.y);
    }
}

@compute @workgroup_size(WG)
fn softmax_cols(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = gid.x + gid.y * groups.x * WG;
    if i >= p.outer * p.inner { return; }
    let base = (i / p.inner) * p.r * p.inner + i % p.inner;
    var m = f32(a[base]);
    for (var k = 0u; k < p.r; k++) { m = max_nan_f32(m, f32(a[base + k * p.inner])); }
    var s = 0.0;
    for (var k = 0u; k < p.r; k++) { s += exp(f32(a[base + k * p.inner]) - m); }
    for (var k = 0u; k < p.r; k++) {
        out[base + k * p.inner] = O(exp(f32(a[base + k * p.inner]) - m) / s);
    }
}
