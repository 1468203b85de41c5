// Q8_0: [d: f16 | pad], 32 int8; w = d q.
const FORMAT_WORDS: u32 = 9u;
const FORMAT_BLOCKS: u32 = 1u;

fn load_block(row_blocks: u32, n: u32, b: u32) -> QBlock {
    let at = block_at(row_blocks, n, b);
    let d = unpack2x16float(qword(at)).x;
    return uniform_block(bytes_signed(qword(at + 1u)), bytes_signed(qword(at + 2u)), bytes_signed(qword(at + 3u)),
                         bytes_signed(qword(at + 4u)), bytes_signed(qword(at + 5u)), bytes_signed(qword(at + 6u)),
                         bytes_signed(qword(at + 7u)), bytes_signed(qword(at + 8u)), d, 0.0);
}
