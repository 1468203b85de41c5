// Q4_K, 256 weights (8 sub-blocks of 32): [d | dmin], 12 bytes of 6-bit scales and mins, 128 bytes of
// nibbles (sub-blocks 2i, 2i + 1: the low and high nibbles of bytes 32i..32i + 31); w = d sc q - dmin m.
const FORMAT_WORDS: u32 = 36u;
const FORMAT_BLOCKS: u32 = 8u;

fn load_block(row_blocks: u32, n: u32, b: u32) -> QBlock {
    let at = block_at(row_blocks, n, b);
    let s = b % 8u;
    let dm = k_scale(at, s);
    return k_block(at + 4u + 8u * (s / 2u), 4u * (s % 2u), at, 0u, 0u, dm.x, dm.y, dm.x, dm.y);
}
