// Workgroup tree reductions of one f32 per invocation (WG a power of two). Every invocation of the
// workgroup must call them in uniform control flow: they contain barriers. tree_max propagates NaN like
// numpy (max_nan_f32: a family including tree also includes lib/nan.wgsl).
var<workgroup> partial: array<f32, WG>;

fn tree_sum(lid: u32, value: f32) -> f32 {
    partial[lid] = value;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        if lid < stride { partial[lid] = partial[lid] + partial[lid + stride]; }
        workgroupBarrier();
    }
    let result = partial[0];
    workgroupBarrier();
    return result;
}

fn tree_max(lid: u32, value: f32) -> f32 {
    partial[lid] = value;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        if lid < stride { partial[lid] = max_nan_f32(partial[lid], partial[lid + stride]); }
        workgroupBarrier();
    }
    let result = partial[0];
    workgroupBarrier();
    return result;
}
