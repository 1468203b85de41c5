// NaN tests and numpy's NaN-propagating max/min (np.maximum, np.minimum, np.max). WGSL implementations
// may assume floats are never NaN (`x != x` may fold to false) and their max/min/clamp may return the
// non-NaN operand (IEEE maxNum), so NaN is found by bit pattern. IS_FLOAT: the data (alias C) is float,
// set by the lowering from the dtype (float16 computes in f32); integer bit patterns never count as NaN.
override IS_FLOAT: bool = false;

fn nan_bits(bits: u32) -> bool {
    return (bits & 0x7fffffffu) > 0x7f800000u;
}

fn is_nan_f32(v: f32) -> bool {
    return nan_bits(bitcast<u32>(v));
}

fn is_nan(v: C) -> bool {
    return IS_FLOAT && nan_bits(bitcast<u32>(v));
}

// max/min returning x if x is NaN, else y if y is NaN.
fn max_nan(x: C, y: C) -> C {
    return select(select(max(x, y), y, is_nan(y)), x, is_nan(x));
}

fn min_nan(x: C, y: C) -> C {
    return select(select(min(x, y), y, is_nan(y)), x, is_nan(x));
}

fn max_nan_f32(x: f32, y: f32) -> f32 {
    return select(select(max(x, y), y, is_nan_f32(y)), x, is_nan_f32(x));
}
