// Q4_0: [d: f16 | pad], 16 bytes of nibbles (byte j: weight j low, j + 16 high); w = d (q - 8).
const FORMAT_WORDS: u32 = 5u;
const FORMAT_BLOCKS: u32 = 1u;

fn load_block(row_blocks: u32, n: u32, b: u32) -> QBlock {
    let at = block_at(row_blocks, n, b);
    let d = unpack2x16float(qword(at)).x;
    let w1 = qword(at + 1u); let w2 = qword(at + 2u); let w3 = qword(at + 3u); let w4 = qword(at + 4u);
    return uniform_block(nibbles_low(w1), nibbles_low(w2), nibbles_low(w3), nibbles_low(w4),
                         nibbles_high(w1), nibbles_high(w2), nibbles_high(w3), nibbles_high(w4), d, -8.0 * d);
}
