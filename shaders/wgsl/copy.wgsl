// Strided copy with dtype conversion: transpose, permute, slice, concat and cast of strided views.
// Thread i decodes its index over `shape` and copies src[src_base + idx . src_strides] to
// dst[dst_base + idx . dst_strides]. Aliases: A (source), O (destination), C (compute type of A).

//!interface

@compute @workgroup_size(WG)
fn strided_copy(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = gid.x + gid.y * groups.x * WG;
    if i >= p.n { return; }
    var rem = i;
    var s = p.src_base;
    var t = p.dst_base;
    var d = p.ndim;
    loop {
        if d == 0u { break; }
        d -= 1u;
        let extent = p.shape[d / 4u][d % 4u];
        let index = i32(rem % extent);
        rem /= extent;
        s += index * p.src_strides[d / 4u][d % 4u];
        t += index * p.dst_strides[d / 4u][d % 4u];
    }
    dst[u32(t)] = O(C(src[u32(s)]));
}
