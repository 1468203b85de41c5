// Q6_K, 256 weights: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one per 16
// weights), [d | pad]. Sub-block s = 4h + i: its weight j takes the low (i < 2) or high nibble of ql byte
// 64h + 32 (i % 2) + j and bits 2i, 2i + 1 of qh byte 32h + j; w = d sc (q - 32).
const FORMAT_WORDS: u32 = 53u;
const FORMAT_BLOCKS: u32 = 8u;

fn load_block(row_blocks: u32, n: u32, b: u32) -> QBlock {
    let at = block_at(row_blocks, n, b);
    let s = b % 8u;
    let h = s / 4u;
    let i = s % 4u;
    let d = unpack2x16float(qword(at + 52u)).x;
    let d0 = d * f32(extractBits(i32(qbyte(at + 48u, 2u * s)), 0u, 8u));
    let d1 = d * f32(extractBits(i32(qbyte(at + 48u, 2u * s + 1u)), 0u, 8u));
    return k_block(at + 16u * h + 8u * (i % 2u), 4u * (i / 2u), at + 32u + 8u * h, 2u * i, 3u, d0, -32.0 * d0, d1,
                   -32.0 * d1);
}
