// Exact GELU for the op expressions (batchgpu/ops/elementwise.py's gelu), shared by elementwise.wgsl and
// fused.wgsl.

// Phi(-a) = erfc(a / sqrt(2)) / 2 for a >= 0, to a few ulp (mirrored in shaders/cuda/prelude.cuh):
// Numerical Recipes' erfcc (relative error below 1.2e-7 everywhere: a Chebyshev fit of the exponent),
// with exp(-a^2 / 2) taken from a directly as exp(-ah^2 / 2) * exp(-(a - ah)(a + ah) / 2), ah = a cut to
// 8 fraction bits, so that ah^2 is exact in f32 while a < 16 (beyond, the tail underflows anyway):
// rounding a / sqrt(2) first would be amplified 2z^2-fold in the tail.
fn normal_tail(a: f32) -> f32 {
    let t = 1.0 / (1.0 + 0.35355339059327373 * a);
    let poly = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806
             + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))));
    let ah = trunc(a * 256.0) / 256.0;
    return 0.5 * t * exp_precise(-0.5 * ah * ah) * exp_precise(-0.5 * (a - ah) * (a + ah) + poly);
}

// Exact GELU, x * Phi(x) (torch's default gelu); past |x| = 16 the tail (< 1e-57) is 0, also for inf.
fn gelu_erf(x: f32) -> f32 {
    let tail = select(normal_tail(abs(x)), 0.0, abs(x) > 16.0);
    return x * select(tail, 1.0 - tail, x >= 0.0);
}

// e^a to about 2 ulp (WGSL's exp may be off by 3 + 2|a| ulp, ~1e-5 relative at a = -80): a = k ln2 + r
// with ln2 split in two (Cody-Waite, Cephes' constants), e^r by its Taylor series to r^7 (|r| <= 0.347).
fn exp_precise(a: f32) -> f32 {
    let k = round(a * 1.4426950408889634);
    let r = (a - k * 0.693359375) + k * 2.12194440e-4;
    let p = 1.0 + r * (1.0 + r * (0.5 + r * (0.16666667 + r * (0.041666668 + r * (0.008333334
          + r * (0.0013888889 + r * 0.0001984127))))));
    return ldexp(p, i32(k));
}
