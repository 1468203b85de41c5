// Q5_1: [d: f16 | m: f16], qh (bit j: the fifth bit of weight j), 16 bytes of nibbles; w = d q + m.
const FORMAT_WORDS: u32 = 6u;
const FORMAT_BLOCKS: u32 = 1u;

fn load_block(row_blocks: u32, n: u32, b: u32) -> QBlock {
    let at = block_at(row_blocks, n, b);
    let dm = unpack2x16float(qword(at));
    return nibble_block(at + 2u, qword(at + 1u), dm.x, dm.y);
}
