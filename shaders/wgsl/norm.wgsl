// Row normalizations, sums in f32 through a tree in workgroup memory.
// rms_norm:      out = x * rsqrt(mean(x^2) + eps) * w
// add_rms_norm:  h = x + residual (written to `summed`), out = rms_norm(h) * w
// layer_norm:    out = (x - mean) * rsqrt(var + eps) * w + b
// *_rows: rows of at most one chunk, one workgroup per row.
// Longer rows, in pieces of p.chunk elements, one workgroup per (row, piece) in two passes: *_partials
// write each piece's statistics to `partials` (rms: the sum of squares; layer_norm: the sum and the sum of
// squared deviations from the piece's mean), *_chunks combine the row's partials and write their piece.
// Aliases: A (storage type of every tensor), C (f32), H (f32; f16 in the half form, HALF: see scaled).

//!interface

//!include tree
//!include nan

// An output element: a normalized value times its weight; in the half form (HALF, a launch's Launch.for_half:
// alias H = f16) the product is f16. The statistics stay f32 in both forms.
fn scaled(normed: f32, weight: f32) -> f32 {
    if HALF { return f32(H(normed) * H(weight)); }
    return normed * weight;
}

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
        out[base + k] = A(scaled(f32(x[base + k]) * scale, f32(w[k])));
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
        out[base + k] = A(scaled(v * scale, f32(w[k])));
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
        out[base + k] = A(scaled((f32(x[base + k]) - mean) * scale, f32(w[k])) + f32(extra[k]));
    }
}

// Long rows ---------------------------------------------------------------------------------------

//!include pieces

fn chunks() -> u32 {
    return (p.d - 1u) / p.chunk + 1u;
}

fn piece_of(wid: vec3<u32>, groups: vec3<u32>) -> Piece {
    return piece_at(row_of(wid, groups), p.rows, p.d, p.chunk);
}

@compute @workgroup_size(WG)
fn rms_norm_partials(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
                     @builtin(num_workgroups) groups: vec3<u32>) {
    let piece = piece_of(wid, groups);
    let base = piece.row * p.d + piece.first;
    var squares = 0.0;
    for (var k = lid.x; k < piece.count; k += WG) {
        let v = f32(x[base + k]);
        squares += v * v;
    }
    let piece_squares = tree_sum(lid.x, squares);
    if lid.x == 0u && piece.valid { partials[piece.index] = piece_squares; }
}

@compute @workgroup_size(WG)
fn add_rms_norm_partials(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
                         @builtin(num_workgroups) groups: vec3<u32>) {
    let piece = piece_of(wid, groups);
    let base = piece.row * p.d + piece.first;
    var squares = 0.0;
    for (var k = lid.x; k < piece.count; k += WG) {
        let v = f32(x[base + k]) + f32(extra[base + k]);
        squares += v * v;
        if piece.valid { summed[base + k] = A(v); }
    }
    let piece_squares = tree_sum(lid.x, squares);
    if lid.x == 0u && piece.valid { partials[piece.index] = piece_squares; }
}

// rsqrt(mean(x^2) + eps) of the piece's row, from its pieces' sums of squares.
fn rms_scale(lid: u32, piece: Piece) -> f32 {
    let first = piece.row * chunks();
    var squares = 0.0;
    for (var j = lid; j < chunks(); j += WG) { squares += partials[first + j]; }
    return inverseSqrt(tree_sum(lid, squares) / f32(p.d) + p.eps);
}

@compute @workgroup_size(WG)
fn rms_norm_chunks(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
                   @builtin(num_workgroups) groups: vec3<u32>) {
    let piece = piece_of(wid, groups);
    let scale = rms_scale(lid.x, piece);
    if !piece.valid { return; }
    let base = piece.row * p.d + piece.first;
    for (var k = lid.x; k < piece.count; k += WG) {
        out[base + k] = A(scaled(f32(x[base + k]) * scale, f32(w[piece.first + k])));
    }
}

@compute @workgroup_size(WG)
fn add_rms_norm_chunks(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
                       @builtin(num_workgroups) groups: vec3<u32>) {
    let piece = piece_of(wid, groups);
    let scale = rms_scale(lid.x, piece);
    if !piece.valid { return; }
    let base = piece.row * p.d + piece.first;
    for (var k = lid.x; k < piece.count; k += WG) {
        let v = f32(x[base + k]) + f32(extra[base + k]);
        out[base + k] = A(scaled(v * scale, f32(w[piece.first + k])));
    }
}

@compute @workgroup_size(WG)
fn layer_norm_partials(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
                       @builtin(num_workgroups) groups: vec3<u32>) {
    let piece = piece_of(wid, groups);
    let base = piece.row * p.d + piece.first;
    var total = 0.0;
    for (var k = lid.x; k < piece.count; k += WG) { total += f32(x[base + k]); }
    let piece_total = tree_sum(lid.x, total);
    let mean = piece_total / f32(piece.count);
    var deviations = 0.0;
    for (var k = lid.x; k < piece.count; k += WG) {
        let c = f32(x[base + k]) - mean;
        deviations += c * c;
    }
    let piece_deviations = tree_sum(lid.x, deviations);
    if lid.x == 0u && piece.valid {
        partials[2u * piece.index] = piece_total;
        partials[2u * piece.index + 1u] = piece_deviations;
    }
}

// (mean, rsqrt(var + eps)) of the piece's row from its pieces' (sum, squared deviations) partials, with
// Chan et al.'s parallel formula: row deviations = sum over pieces of (deviations + n * (piece mean - mean)^2).
fn layer_stats(lid: u32, piece: Piece) -> vec2<f32> {
    let first = piece.row * chunks();
    var total = 0.0;
    for (var j = lid; j < chunks(); j += WG) { total += partials[2u * (first + j)]; }
    let mean = tree_sum(lid, total) / f32(p.d);
    var deviations = 0.0;
    for (var j = lid; j < chunks(); j += WG) {
        let n = f32(min(p.chunk, p.d - j * p.chunk));
        let offset = partials[2u * (first + j)] / n - mean;
        deviations += partials[2u * (first + j) + 1u] + n * offset * offset;
    }
    return vec2(mean, inverseSqrt(tree_sum(lid, deviations) / f32(p.d) + p.eps));
}

@compute @workgroup_size(WG)
fn layer_norm_chunks(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
                     @builtin(num_workgroups) groups: vec3<u32>) {
    let piece = piece_of(wid, groups);
    let stats = layer_stats(lid.x, piece);
    if !piece.valid { return; }
    let base = piece.row * p.d + piece.first;
    for (var k = lid.x; k < piece.count; k += WG) {
        let c = piece.first + k;
        out[base + k] = A(scaled((f32(x[base + k]) - stats.x) * stats.y, f32(w[c])) + f32(extra[c]));
    }
}
