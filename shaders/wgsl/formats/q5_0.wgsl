// Q5_0: [d: f16 | pad], qh (bit j: the fifth bit of weight j), 16 bytes of nibbles; w = d (q - 16).
const FORMAT_WORDS: u32 = 6u;
const FORMAT_BLOCKS: u32 = 1u;

fn load_block(row_blocks: u32, n: u32, b: u32) -> QBlock {
    let at = block_at(row_blocks, n, b);
    let d = unpack2x16float(qword(at)).x;
    let h = qword(at + 1u);
    let w1 = qword(at + 2u); let w2 = qword(at + 3u); let w3 = qword(at + 4u); let w4 = qword(at + 5u);
    return uniform_block(
        nibbles_low(w1) + 16.0 * bits4(h, 0u), nibbles_low(w2) + 16.0 * bits4(h, 4u),
        nibbles_low(w3) + 16.0 * bits4(h, 8u), nibbles_low(w4) + 16.0 * bits4(h, 12u),
        nibbles_high(w1) + 16.0 * bits4(h, 16u), nibbles_high(w2) + 16.0 * bits4(h, 20u),
        nibbles_high(w3) + 16.0 * bits4(h, 24u), nibbles_high(w4) + 16.0 * bits4(h, 28u), d, -16.0 * d);
}
