// Tiled matmul: out[z] = A[z] (M x K) @ B[z] (K x N). Each 16x16 workgroup computes a 64x64 output
// tile; k advances 16 at a time through tiles staged in workgroup memory; each invocation keeps 4x4
// accumulators in registers. Operands are read through element strides, so transposes are free.
// Aliases: A (operand type), O (output), C (accumulator type).

const TILE: u32 = 64u;
const TK: u32 = 16u;

struct Params {
    m: u32,
    n: u32,
    k: u32,
    batch_ndim: u32,
    strides: vec4<u32>,                 // a_sm, a_sk, b_sk, b_sn
    pad: vec4<u32>,
    batch_shape: array<vec4<u32>, 2>,
    a_batch_strides: array<vec4<u32>, 2>,
    b_batch_strides: array<vec4<u32>, 2>,
}

@group(0) @binding(0) var<storage, read> a: array<A>;
@group(0) @binding(1) var<storage, read> b: array<A>;
@group(0) @binding(2) var<storage, read_write> out: array<O>;
@group(0) @binding(3) var<uniform> p: Params;

var<workgroup> a_tile: array<C, 1024>;   // [TK][TILE]
var<workgroup> b_tile: array<C, 1024>;   // [TK][TILE]

@compute @workgroup_size(16, 16)
fn matmul(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    var rem = wid.z;
    var a_base = 0u;
    var b_base = 0u;
    var d = p.batch_ndim;
    loop {
        if d == 0u { break; }
        d -= 1u;
        let extent = p.batch_shape[d / 4u][d % 4u];
        let index = rem % extent;
        rem /= extent;
        a_base += index * p.a_batch_strides[d / 4u][d % 4u];
        b_base += index * p.b_batch_strides[d / 4u][d % 4u];
    }
    let a_sm = p.strides.x;
    let a_sk = p.strides.y;
    let b_sk = p.strides.z;
    let b_sn = p.strides.w;
    let row0 = wid.y * TILE;
    let col0 = wid.x * TILE;
    let tid = lid.y * 16u + lid.x;

    var acc: array<C, 16>;
    for (var k0 = 0u; k0 < p.k; k0 += TK) {
        for (var t = 0u; t < 4u; t++) {
            let e = tid + t * 256u;
            let am = e / TK;
            let ak = e % TK;
            var av = C(0);
            if row0 + am < p.m && k0 + ak < p.k {
                av = C(a[a_base + (row0 + am) * a_sm + (k0 + ak) * a_sk]);
            }
            a_tile[ak * TILE + am] = av;
            let bk = e / TILE;
            let bn = e % TILE;
            var bv = C(0);
            if k0 + bk < p.k && col0 + bn < p.n {
                bv = C(b[b_base + (k0 + bk) * b_sk + (col0 + bn) * b_sn]);
            }
            b_tile[bk * TILE + bn] = bv;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < TK; kk++) {
            var ar: array<C, 4>;
            var br: array<C, 4>;
            for (var i = 0u; i < 4u; i++) {
                ar[i] = a_tile[kk * TILE + lid.y * 4u + i];
                br[i] = b_tile[kk * TILE + lid.x * 4u + i];
            }
            for (var i = 0u; i < 4u; i++) {
                for (var j = 0u; j < 4u; j++) {
                    acc[i * 4u + j] += ar[i] * br[j];
                }
            }
        }
        workgroupBarrier();
    }
    let out_base = wid.z * p.m * p.n;
    for (var i = 0u; i < 4u; i++) {
        let row = row0 + lid.y * 4u + i;
        for (var j = 0u; j < 4u; j++) {
            let col = col0 + lid.x * 4u + j;
            if row < p.m && col < p.n {
                out[out_base + row * p.n + col] = O(acc[i * 4u + j]);
            }
        }
    }
}
