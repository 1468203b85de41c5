// Q5_0: [d: f16 | pad], qh (bit j: the fifth bit of weight j), 16 bytes of nibbles; w = d (q - 16).
const FORMAT_WORDS: u32 = 6u;
const FORMAT_BLOCKS: u32 = 1u;

fn load_block(row_blocks: u32, n: u32, b: u32) -> QBlock {
    let at = block_at(row_blocks, n, b);
    let d = unpack2x16float(qword(at)).x;
    return nibble_block(at + 2u, qword(at + 1u), d, -16.0 * d);
}
