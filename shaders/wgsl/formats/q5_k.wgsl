// Q5_K, 256 weights (8 sub-blocks of 32): [d | dmin], 12 bytes of 6-bit scales and mins, 32 bytes of fifth
// bits (bit s of byte j: sub-block s, weight j), 128 bytes of nibbles as Q4_K; w = d sc q - dmin m.
const FORMAT_WORDS: u32 = 44u;
const FORMAT_BLOCKS: u32 = 8u;

fn load_block(row_blocks: u32, n: u32, b: u32) -> QBlock {
    let at = block_at(row_blocks, n, b);
    let s = b % 8u;
    let dm = k_scale(at, s);
    return k_block(at + 12u + 8u * (s / 2u), 4u * (s % 2u), at + 4u, s, 1u, dm.x, dm.y, dm.x, dm.y);
}
