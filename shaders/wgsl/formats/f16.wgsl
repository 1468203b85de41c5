// F16: 32 float16 weights; w = q.
const FORMAT_WORDS: u32 = 16u;
const FORMAT_BLOCKS: u32 = 1u;

fn halves4(at: u32) -> vec4<f32> {
    return vec4<f32>(unpack2x16float(qword(at)), unpack2x16float(qword(at + 1u)));
}

fn load_block(row_blocks: u32, n: u32, b: u32) -> QBlock {
    let at = block_at(row_blocks, n, b);
    return uniform_block(halves4(at), halves4(at + 2u), halves4(at + 4u), halves4(at + 6u), halves4(at + 8u),
                         halves4(at + 10u), halves4(at + 12u), halves4(at + 14u), 1.0, 0.0);
}
