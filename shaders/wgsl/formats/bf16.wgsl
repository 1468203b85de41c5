// BF16: 32 bfloat16 weights (the top halves of float32s); w = q.
const FORMAT_WORDS: u32 = 16u;
const FORMAT_BLOCKS: u32 = 1u;

fn brain4(at: u32) -> vec4<f32> {
    let a = qword(at);
    let c = qword(at + 1u);
    return vec4<f32>(bitcast<f32>(a << 16u), bitcast<f32>(a & 0xFFFF0000u), bitcast<f32>(c << 16u),
                     bitcast<f32>(c & 0xFFFF0000u));
}

fn load_block(row_blocks: u32, n: u32, b: u32) -> QBlock {
    let at = block_at(row_blocks, n, b);
    return uniform_block(brain4(at), brain4(at + 2u), brain4(at + 4u), brain4(at + 6u), brain4(at + 8u),
                         brain4(at + 10u), brain4(at + 12u), brain4(at + 14u), 1.0, 0.0);
}
