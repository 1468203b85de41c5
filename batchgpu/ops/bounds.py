"""Per-invocation work bounds of the built-in kernels.

No invocation of a built-in kernel runs more than about :data:`LOOP_BUDGET` loop iterations in total,
whatever the tensor sizes: lowerings cut longer work into chunks (long rows into pieces whose partial
results an extra pass combines, split-K matmuls, attention over blocks of cache rows) and spread the
chunks over more workgroups.

Why a budget: Mesa's llvmpipe (the lavapipe Vulkan driver) stops an invocation after 65,535 loop
iterations counted over all its loops (nested and sequential ones together) and reports nothing, so a
longer loop silently leaves a wrong result. No WebGPU limit exposes this, so the bound is a design
constant with a 4x margin; on GPUs it also bounds how long one invocation runs.

Lowerings read these names at record time (``bounds.ROW_CHUNK``, not a copy), so tests can shrink them
to run the chunked paths at small sizes on every executor.
"""

from __future__ import annotations

LOOP_BUDGET = 16384
"""Loop iterations one invocation of a built-in kernel may run in total (llvmpipe stops at 65,535)."""

WHOLE_ROW_BUDGET = 2 * LOOP_BUDGET
"""Loop iterations of one invocation of a kernel that keeps a whole row in one workgroup and runs several
passes over it (``sample``, ``logprobs``: their selection state lives in workgroup memory, so a row is not
cut into pieces): twice :data:`LOOP_BUDGET`, still a 2x margin under llvmpipe's 65,535, which lets one
workgroup take Gemma 3's 262,144-token rows."""

ROW_CHUNK = 256 * 256
"""Elements of a row one 256-invocation workgroup handles in one pass (256 iterations per loop);
longer rows take extra passes over per-chunk partial results (reductions, softmax, norms, argmax)."""

COLUMN_LIMIT = 4096
"""Longest extent one invocation walks along a column (``*_cols`` kernels: up to three loops of it);
longer reduced extents are permuted into rows first."""

MATMUL_K_CHUNK = 8192
"""Inner-dimension (K) length one matmul invocation accumulates; longer K is split over workgroups
into partial products that a reduction pass sums (split-K). A multiple of the 16-deep k tile. Loop
iterations per invocation at this chunk, as llvmpipe counts them: the tiled kernel 18 per 16-deep k tile
(its inner k loop is not unrolled: measured, (9, K) @ (K, 2) runs up to K = 58240) = 9216; matmul_skinny
one per k = 8192; matmul_gemv_t (GPU form) about 10 per 128 k = 640; matmul_128 (native only) 6 per 8 k."""

QUANT_BLOCK_CHUNK = 8192
"""32-weight blocks along K that one quantized-matmul invocation accumulates before split-K: one loop
iteration per block in matmul_q4_1 / matmul_q8_0 (8192), one per 32 words of the blocks in their
``_warp`` GPU forms (2048 for Q8_0)."""

WORKGROUP_BYTES = 16384
"""Workgroup memory a built-in kernel sizes its blocks for: WebGPU's default maxComputeWorkgroupStorageSize,
so the kernels fit every adapter (launches are still checked against the device's own limit). Attention
takes cache rows in blocks whose scores fit it."""
