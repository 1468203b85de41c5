// Elementwise ops. Rendered with type aliases A, B (inputs), O (output), C (compute type) and the op
// expressions ${UNARY} (of x) and ${BINARY} (of x, y) (batchgpu/ops/elementwise.py's EXPRESSIONS). Inputs
// with A_MODE/B_MODE CONTIGUOUS are read at the output index, SCALAR is a broadcast scalar, STRIDED is read
// through broadcast strides (b from element p.b_base on). IS_FLOAT (lib/nan.wgsl): float data, for the NaN-propagating
// max_nan/min_nan/is_nan of the op expressions.

//!interface

//!include nan

//!include gelu

//!include math

//!include convert

// x in the output type: a cast from float to an integer type converts as lib/convert.wgsl defines it.
fn output(x: C) -> O {
    let to_integer = IS_FLOAT && O(0.5f) == O(0i);
    if to_integer && O(-1i) < O(0i) { return O(f32_to_i32(bitcast<f32>(x))); }
    if to_integer { return O(f32_to_u32(bitcast<f32>(x))); }
    return O(x);
}

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
    out[i] = output(unary_op(C(a[i])));
}

@compute @workgroup_size(WG)
fn binary(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = gid.x + gid.y * groups.x * WG;
    if i >= p.n { return; }
    var ia = i;
    var ib = i;
    if A_MODE == STRIDED || B_MODE == STRIDED {
        let offsets = broadcast_offsets(i);
        if A_MODE == STRIDED { ia = offsets.x; }
        if B_MODE == STRIDED { ib = p.b_base + offsets.y; }
    }
    if A_MODE == SCALAR { ia = 0u; }
    if B_MODE == SCALAR { ib = 0u; }
    out[i] = O(binary_op(C(a[ia]), C(b[ib])));
}
