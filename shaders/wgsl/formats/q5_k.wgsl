// Q5_K, 256 weights (8 sub-blocks of 32): [d | dmin], 12 bytes of 6-bit scales and mins, 32 bytes of fifth
// bits (bit s of byte j: sub-block s, weight j), 128 bytes of nibbles as Q4_K; w = d sc q - dmin m.
const FORMAT_WORDS: u32 = 44u;
const FORMAT_BLOCKS: u32 = 8u;

fn q5_k_quad(base: u32, high: u32, k: u32, shift: u32, s: u32) -> vec4<f32> {
    return byte_fields(qword(base + k), shift, 15u) + 16.0 * byte_fields(qword(high + k), s, 1u);
}

fn load_block(row_blocks: u32, n: u32, b: u32) -> QBlock {
    let at = block_at(row_blocks, n, b);
    let s = b % 8u;
    let dm = unpack2x16float(qword(at));
    let sm = k_scale_min(at + 1u, s);
    let base = at + 12u + 8u * (s / 2u);
    let high = at + 4u;
    let shift = 4u * (s % 2u);
    return uniform_block(
        q5_k_quad(base, high, 0u, shift, s), q5_k_quad(base, high, 1u, shift, s),
        q5_k_quad(base, high, 2u, shift, s), q5_k_quad(base, high, 3u, shift, s),
        q5_k_quad(base, high, 4u, shift, s), q5_k_quad(base, high, 5u, shift, s),
        q5_k_quad(base, high, 6u, shift, s), q5_k_quad(base, high, 7u, shift, s),
        dm.x * sm.x, -dm.y * sm.y);
}
