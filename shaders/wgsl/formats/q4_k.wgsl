// Q4_K, 256 weights (8 sub-blocks of 32): [d | dmin], 12 bytes of 6-bit scales and mins, 128 bytes of
// nibbles (sub-blocks 2i, 2i + 1: the low and high nibbles of bytes 32i..32i + 31); w = d sc q - dmin m.
const FORMAT_WORDS: u32 = 36u;
const FORMAT_BLOCKS: u32 = 8u;

fn load_block(row_blocks: u32, n: u32, b: u32) -> QBlock {
    let at = block_at(row_blocks, n, b);
    let s = b % 8u;
    let dm = unpack2x16float(qword(at));
    let sm = k_scale_min(at + 1u, s);
    let base = at + 4u + 8u * (s / 2u);
    let shift = 4u * (s % 2u);
    return uniform_block(
        byte_fields(qword(base), shift, 15u), byte_fields(qword(base + 1u), shift, 15u),
        byte_fields(qword(base + 2u), shift, 15u), byte_fields(qword(base + 3u), shift, 15u),
        byte_fields(qword(base + 4u), shift, 15u), byte_fields(qword(base + 5u), shift, 15u),
        byte_fields(qword(base + 6u), shift, 15u), byte_fields(qword(base + 7u), shift, 15u),
        dm.x * sm.x, -dm.y * sm.y);
}
