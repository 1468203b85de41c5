// Elementwise ops. Rendered with type aliases A, B (inputs), O (output), C (compute type) and the op
// expressions ${UNARY} (of x) and ${BINARY} (of x, y). Inputs with A_MODE/B_MODE 0 are read at the
// output index, 1 is a broadcast scalar, 2 is read through broadcast strides.

override WG: u32 = 256u;
override A_MODE: u32 = 0u;
override B_MODE: u32 = 0u;

struct Params {
    n: u32,
    ndim: u32,
    pad0: u32,
    pad1: u32,
    shape: array<vec4<u32>, 2>,
    a_strides: array<vec4<u32>, 2>,
    b_strides: array<vec4<u32>, 2>,
}

@group(0) @binding(0) var<storage, read> a: array<A>;
@group(0) @binding(1) var<storage, read> b: array<B>;
@group(0) @binding(2) var<storage, read_write> out: array<O>;
@group(0) @binding(3) var<uniform> p: Params;

fn unary_op(x: C) -> C {
    return ${UNARY};
}

fn binary_op(x: C, y: C) -> C {
    return ${BINARY};
}

fn broadcast_offsets(i: u32) -> vec2<u32> {
    var rem = i;
    var offsets = vec2<u32>(0u, 0u);
    var d = p.ndim;
    loop {
        if d == 0u { break; }
        d -= 1u;
        let extent = p.shape[d / 4u][d % 4u];
        let index = rem % extent;
        rem /= extent;
        offsets += index * vec2<u32>(p.a_strides[d / 4u][d % 4u], p.b_strides[d / 4u][d % 4u]);
    }
    return offsets;
}

@compute @workgroup_size(WG)
fn unary(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = gid.x + gid.y * groups.x * WG;
    if i >= p.n { return; }
    out[i] = O(unary_op(C(a[i])));
}

@compute @workgroup_size(WG)
fn binary(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = gid.x + gid.y * groups.x * WG;
    if i >= p.n { return; }
    var ia = i;
    var ib = i;
    if A_MODE == 2u || B_MODE == 2u {
        let offsets = broadcast_offsets(i);
        if A_MODE == 2u { ia = offsets.x; }
        if B_MODE == 2u { ib = offsets.y; }
    }
    if A_MODE == 1u { ia = 0u; }
    if B_MODE == 1u { ib = 0u; }
    out[i] = O(binary_op(C(a[ia]), C(b[ib])));
}
