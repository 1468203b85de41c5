// Fused elementwise chains (batchgpu/fusion.py groups them, batchgpu/ops/fused.py renders them): one
// invocation per output element runs a program of op expressions over up to six inputs of their own
// dtypes (aliases I0..I5). The FUNCTIONS placeholder is one function per op of the program (its expression from the
// op-expression table, in the compute type C); BODY loads each input (at the output index, as a
// broadcast scalar, or through its strides: input_offset), applies the ops in recording order, rounds
// every intermediate through its own dtype as the unfused ops would store it (float16: round_f16 of
// lib/half.wgsl; a float cast to an integer type: lib/convert.wgsl), and names the last value `result`.
// IS_FLOAT (lib/nan.wgsl): C is a float type.

//!interface

//!include nan

//!include gelu

//!include math

//!include half

//!include convert

${FUNCTIONS}

// Element offset of input k for output element i: i unravelled over p.shape, dotted with k's strides.
fn input_offset(i: u32, k: u32) -> u32 {
    var rem = i;
    var offset = 0u;
    var d = p.ndim;
    loop {
        if d == 0u { break; }
        d -= 1u;
        let extent = p.shape[d / 4u][d % 4u];
        let at = k * MAX_DIMS + d;
        offset += (rem % extent) * p.strides[at / 4u][at % 4u];
        rem /= extent;
    }
    return offset;
}

@compute @workgroup_size(WG)
fn fused(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = gid.x + gid.y * groups.x * WG;
    if i >= p.n { return; }
    ${BODY}
    out[i] = O(result);
}
