// argmax's order and its workgroup tree over (value, index) pairs of the compute type C: NaN first (is_nan of
// lib/nan.wgsl, so IS_FLOAT must be set for float data), then the larger value, then the lower index.
var<workgroup> best_value: array<C, WG>;
var<workgroup> best_index: array<u32, WG>;

// Whether (v, k) comes before (best, at) in argmax order.
fn better(v: C, k: u32, best: C, at: u32) -> bool {
    let v_nan = is_nan(v);
    let best_nan = is_nan(best);
    if v_nan || best_nan { return v_nan && (!best_nan || k < at); }
    return v > best || (v == best && k < at);
}

// The index of the best (value, index) pair of the workgroup. Every invocation must call it (barriers).
fn tree_best(lid: u32, value: C, index: u32) -> u32 {
    best_value[lid] = value;
    best_index[lid] = index;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        let other = lid + stride;
        if lid < stride && better(best_value[other], best_index[other], best_value[lid], best_index[lid]) {
            best_value[lid] = best_value[other];
            best_index[lid] = best_index[other];
        }
        workgroupBarrier();
    }
    let result = best_index[0];
    workgroupBarrier();
    return result;
}
