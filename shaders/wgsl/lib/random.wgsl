// Counter-based random numbers: a 32-bit hash of (seed, counter, index) from nested PCG hashes (Jarzynski
// and Olano, "Hash Functions for GPU Rendering", 2020), and a uniform number in (0, 1) from it. Mirrored by
// bg_hash3 / bg_hash_uniform in shaders/cuda/prelude.cuh and by hash3 / hash_uniform in
// batchgpu/ops/sampling.py. For a fixed (seed, counter), index -> hash is a bijection of u32.
fn pcg_hash(v: u32) -> u32 {
    let state = v * 747796405u + 2891336453u;
    let word = ((state >> ((state >> 28u) + 4u)) ^ state) * 277803737u;
    return (word >> 22u) ^ word;
}

fn hash3(seed: u32, counter: u32, index: u32) -> u32 {
    return pcg_hash(seed ^ pcg_hash(counter ^ pcg_hash(index)));
}

// (m + 0.5) / 2^23 for the top 23 bits m of h: exact in f32 (24 significant bits), never 0 or 1.
fn hash_uniform(h: u32) -> f32 {
    return (f32(h >> 9u) + 0.5) * 1.1920928955078125e-7;
}
