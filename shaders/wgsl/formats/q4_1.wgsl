// Q4_1: [d: f16 | m: f16], 16 bytes of nibbles (byte j: weight j low, j + 16 high); w = d q + m.
const FORMAT_WORDS: u32 = 5u;
const FORMAT_BLOCKS: u32 = 1u;

fn load_block(row_blocks: u32, n: u32, b: u32) -> QBlock {
    let at = block_at(row_blocks, n, b);
    let dm = unpack2x16float(qword(at));
    return nibble_block(at + 1u, 0u, dm.x, dm.y);
}
