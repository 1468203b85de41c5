// A 32-weight block of quantized weights dequantized in registers (batchgpu/quant.py has the formats; the
// format's load_block is rendered in from shaders/wgsl/formats/). Weights 4i..4i+3 are q<i>, as raw
// quant values: weight j is d0 * q + m0 for j < 16, d1 * q + m1 after. The including family defines
// qword(i), word i of its quantized buffer.
struct QBlock {
    q0: vec4<f32>, q1: vec4<f32>, q2: vec4<f32>, q3: vec4<f32>,
    q4: vec4<f32>, q5: vec4<f32>, q6: vec4<f32>, q7: vec4<f32>,
    d0: f32, m0: f32, d1: f32, m1: f32,
}

// The first word of the format block holding kernel block b (32 weights) of row n of row_blocks blocks.
fn block_at(row_blocks: u32, n: u32, b: u32) -> u32 {
    return (n * (row_blocks / FORMAT_BLOCKS) + b / FORMAT_BLOCKS) * FORMAT_WORDS;
}

// Byte `byte` counted from word `at`.
fn qbyte(at: u32, byte: u32) -> u32 {
    return (qword(at + byte / 4u) >> (8u * (byte % 4u))) & 0xFFu;
}

fn nibbles_low(word: u32) -> vec4<f32> {
    return vec4<f32>(unpack4xU8(word & 0x0F0F0F0Fu));
}

fn nibbles_high(word: u32) -> vec4<f32> {
    return vec4<f32>(unpack4xU8((word >> 4u) & 0x0F0F0F0Fu));
}

fn bytes_signed(word: u32) -> vec4<f32> {
    return vec4<f32>(unpack4xI8(word));
}

// Bits at..at + 3 of h.
fn bits4(h: u32, at: u32) -> vec4<f32> {
    return vec4<f32>((vec4<u32>(h) >> vec4<u32>(at, at + 1u, at + 2u, at + 3u)) & vec4<u32>(1u));
}

// The `width` bits from bit `at` of each byte of word.
fn byte_fields(word: u32, at: u32, mask: u32) -> vec4<f32> {
    return vec4<f32>((vec4<u32>(word) >> vec4<u32>(at, at + 8u, at + 16u, at + 24u)) & vec4<u32>(mask));
}

// Q4_K / Q5_K: the 6-bit scale and min of sub-block s from the 12 bytes at word `at`.
fn k_scale_min(at: u32, s: u32) -> vec2<f32> {
    if s < 4u {
        return vec2<f32>(f32(qbyte(at, s) & 63u), f32(qbyte(at, s + 4u) & 63u));
    }
    let scale = (qbyte(at, s + 4u) & 0x0Fu) | ((qbyte(at, s - 4u) >> 6u) << 4u);
    let low_min = (qbyte(at, s + 4u) >> 4u) | ((qbyte(at, s) >> 6u) << 4u);
    return vec2<f32>(f32(scale), f32(low_min));
}

fn uniform_block(q0: vec4<f32>, q1: vec4<f32>, q2: vec4<f32>, q3: vec4<f32>, q4: vec4<f32>, q5: vec4<f32>,
                 q6: vec4<f32>, q7: vec4<f32>, d: f32, m: f32) -> QBlock {
    return QBlock(q0, q1, q2, q3, q4, q5, q6, q7, d, m, d, m);
}

// Weight j of a block.
fn block_value(qb: QBlock, j: u32) -> f32 {
    var v: vec4<f32>;
    switch j / 4u {
        case 0u: { v = qb.q0; }
        case 1u: { v = qb.q1; }
        case 2u: { v = qb.q2; }
        case 3u: { v = qb.q3; }
        case 4u: { v = qb.q4; }
        case 5u: { v = qb.q5; }
        case 6u: { v = qb.q6; }
        default: { v = qb.q7; }
    }
    return select(qb.d1 * v[j % 4u] + qb.m1, qb.d0 * v[j % 4u] + qb.m0, j < 16u);
}
