// float16 rounding of a float32 value in float32 (an intermediate of a fused kernel stored as float16 by
// the unfused ops), as numpy's astype(np.float16): to nearest, ties to even, subnormals, overflow to inf
// from 65520 up, the sign kept, NaN stays NaN. Integer arithmetic on the bits: WGSL leaves the rounding
// direction of a conversion to the implementation, and a compiler may fold a conversion to f16 and back
// (NVIDIA's Vulkan compiler does). Mirrored by bg_round_f16 in shaders/cuda/prelude.cuh.
fn round_f16(v: f32) -> f32 {
    let bits = bitcast<u32>(v);
    let magnitude = bits & 0x7fffffffu;
    // normal float16 range: keep 10 of the 23 fraction bits, ties to even (a carry steps the exponent)
    var rounded = (magnitude + 0xfffu + ((magnitude >> 13u) & 1u)) & 0xffffe000u;
    if magnitude < 0x38800000u {  // below 2^-14: a multiple of 2^-24, float16's subnormal step (exact steps)
        rounded = bitcast<u32>(round(bitcast<f32>(magnitude) * 16777216.0) * 5.9604644775390625e-8);
    }
    if magnitude >= 0x477ff000u { rounded = 0x7f800000u; }  // 65520 (the tie above 65504) and up: inf
    if magnitude > 0x7f800000u { rounded = magnitude; }     // NaN
    return bitcast<f32>((bits & 0x80000000u) | rounded);
}
