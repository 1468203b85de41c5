// float32 to an integer type as batchgpu's cast defines it (CUDA's cvt.rzi, Rust's `as`): toward zero,
// saturating at the type's bounds (inf included), NaN to 0. WGSL's own conversion leaves NaN indeterminate
// and saturates at the nearest float32 (2147483520 for i32): the bits are tested first, so the conversion
// only ever sees values in range. Mirrored by bg_f2i / bg_f2u in shaders/cuda/prelude.cuh.
fn f32_to_i32(x: f32) -> i32 {
    let bits = bitcast<u32>(x);
    let magnitude = bits & 0x7fffffffu;
    if magnitude > 0x7f800000u { return 0i; }                                   // NaN
    if magnitude >= 0x4f000000u {                                               // |x| >= 2^31
        return select(bitcast<i32>(0x7fffffffu), bitcast<i32>(0x80000000u), bits != magnitude);
    }
    return i32(x);
}

fn f32_to_u32(x: f32) -> u32 {
    let bits = bitcast<u32>(x);
    if bits > 0x7f800000u { return 0u; }             // NaN and every negative value (-0 and above -1 included)
    if bits >= 0x4f800000u { return 0xffffffffu; }   // 2^32 and up, inf
    return u32(x);
}
