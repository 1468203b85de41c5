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

// The `mask` bits from bit `at` of each byte of word.
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

// Q4_K / Q5_K: (d sc, -dmin m) of sub-block s of the super-block at word `at`.
fn k_scale(at: u32, s: u32) -> vec2<f32> {
    let dm = unpack2x16float(qword(at));
    let sm = k_scale_min(at + 1u, s);
    return vec2<f32>(dm.x * sm.x, -dm.y * sm.y);
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

// The 32 nibbles of the 16 bytes at word `at` (byte j: weight j low, j + 16 high), plus 16 times the
// fifth bits `h` (bit j: weight j; 0 for 4-bit formats); w = d q + m.
fn nibble_block(at: u32, h: u32, d: f32, m: f32) -> QBlock {
    let w1 = qword(at); let w2 = qword(at + 1u); let w3 = qword(at + 2u); let w4 = qword(at + 3u);
    return uniform_block(
        nibbles_low(w1) + 16.0 * bits4(h, 0u), nibbles_low(w2) + 16.0 * bits4(h, 4u),
        nibbles_low(w3) + 16.0 * bits4(h, 8u), nibbles_low(w4) + 16.0 * bits4(h, 12u),
        nibbles_high(w1) + 16.0 * bits4(h, 16u), nibbles_high(w2) + 16.0 * bits4(h, 20u),
        nibbles_high(w3) + 16.0 * bits4(h, 24u), nibbles_high(w4) + 16.0 * bits4(h, 28u), d, m);
}

// A K-quant sub-block: weights 4k..4k+3 take the 4 bits at `shift` of the bytes of word low + k, plus
// 16 times the `mask` bits at `bit` of the bytes of word high + k (mask 0: none); w = d q + m per half.
fn k_block(low: u32, shift: u32, high: u32, bit: u32, mask: u32, d0: f32, m0: f32, d1: f32, m1: f32) -> QBlock {
    return QBlock(
        byte_fields(qword(low), shift, 15u) + 16.0 * byte_fields(qword(high), bit, mask),
        byte_fields(qword(low + 1u), shift, 15u) + 16.0 * byte_fields(qword(high + 1u), bit, mask),
        byte_fields(qword(low + 2u), shift, 15u) + 16.0 * byte_fields(qword(high + 2u), bit, mask),
        byte_fields(qword(low + 3u), shift, 15u) + 16.0 * byte_fields(qword(high + 3u), bit, mask),
        byte_fields(qword(low + 4u), shift, 15u) + 16.0 * byte_fields(qword(high + 4u), bit, mask),
        byte_fields(qword(low + 5u), shift, 15u) + 16.0 * byte_fields(qword(high + 5u), bit, mask),
        byte_fields(qword(low + 6u), shift, 15u) + 16.0 * byte_fields(qword(high + 6u), bit, mask),
        byte_fields(qword(low + 7u), shift, 15u) + 16.0 * byte_fields(qword(high + 7u), bit, mask),
        d0, m0, d1, m1);
}
