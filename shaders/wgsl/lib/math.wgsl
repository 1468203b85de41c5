// Float math for the op expressions (batchgpu/ops/elementwise.py: pow, sin, cos, erf), shared by
// elementwise.wgsl and fused.wgsl; the CUDA expressions use the C library's powf, sinf, cosf, erff.

// NaN and inf from runtime bits (a var): WGSL rejects constant expressions that evaluate to either.
fn nan_f32() -> f32 {
    var bits = 0x7fc00000u;
    return bitcast<f32>(bits);
}

fn inf_f32() -> f32 {
    var bits = 0x7f800000u;
    return bitcast<f32>(bits);
}

// |x| ** y for a = |x| (not NaN) with C's special cases spelled out (drivers' pow differ at 0, inf and
// infinite exponents).
fn pow_magnitude(a: f32, y: f32) -> f32 {
    if a == 0.0 { return select(0.0, inf_f32(), y < 0.0); }
    if a == inf_f32() { return select(inf_f32(), 0.0, y < 0.0); }
    if abs(y) == inf_f32() { return select(select(0.0, inf_f32(), (a > 1.0) == (y > 0.0)), 1.0, a == 1.0); }
    return pow(a, y);
}

// x ** y as numpy (C's pow): x ** 0 and 1 ** y are 1 even for NaN; a negative base keeps the sign rule of
// an integer exponent and gives NaN for another (but -0 and -inf give the magnitude). WGSL's pow is
// defined for x >= 0 only.
fn pow_real(x: f32, y: f32) -> f32 {
    if y == 0.0 || x == 1.0 { return 1.0; }
    if nan_bits(bitcast<u32>(x)) || nan_bits(bitcast<u32>(y)) { return nan_f32(); }
    let magnitude = pow_magnitude(abs(x), y);
    if bitcast<u32>(x) < 0x80000000u { return magnitude; }     // the sign bit is clear
    if y != floor(y) { return select(nan_f32(), magnitude, x == 0.0 || abs(x) == inf_f32()); }
    let odd = abs(y) < 16777216.0 && floor(y * 0.5) * 2.0 != y; // integers past 2^24 are all even
    return select(magnitude, -magnitude, odd);
}

// x reduced by whole turns to about [-pi, pi], 2 pi in two parts (Cody-Waite), where the drivers' sin and
// cos are accurate (their error grows with |x| otherwise); inf and NaN stay NaN.
fn reduce_turns(x: f32) -> f32 {
    let turns = round(x * 0.15915494309189535);
    return (x - turns * 6.28125) - turns * 0.0019353071795864769;
}

// erf(x): a Taylor series near 0 (no cancellation), else 1 - erfc with erfc(a) = 2 Phi(-a sqrt 2) from
// lib/gelu.wgsl's normal_tail (relative error below 1.2e-7).
fn erf_f32(x: f32) -> f32 {
    let a = abs(x);
    if a < 0.5 {
        let z = x * x;
        let series = 1.0 + z * (-0.33333333 + z * (0.1 + z * (-0.023809524 + z * (0.0046296296
                   + z * (-0.00075757576 + z * 0.00010683761)))));
        return 1.1283791670955126 * x * series;
    }
    let tail = select(2.0 * normal_tail(a * 1.4142135623730951), 0.0, a > 11.0);
    return select(tail - 1.0, 1.0 - tail, x >= 0.0);
}
