"""Run the CUDA kernel sources of ``shaders/cuda/`` on the CPU, to test their semantics without a GPU.

This is a test harness, not a device and not part of the library: it checks what the native
executors' kernels compute (and that the grids the op lowering launches match what each kernel
expects), not the driver calls around them, which need a GPU (tests/test_native_ops.py).

Each kernel specialization (the exact source :func:`batchgpu.cuda_source.render` gives NVRTC) is
compiled by g++ as C++ with a small CUDA execution model in front of it: blocks run one after another;
the threads of a block are coroutines (a stack switch on x86-64, ``ucontext`` elsewhere) that switch at
``__syncthreads()`` (and at lane exchanges), so block-level barriers and ``__shared__`` memory (static
storage, one block at a time) behave as on a GPU; between barriers the threads run in turn, forward or
backward alternately, so a missing barrier shows up as wrong results (checked: removing the one in
``bg_tree``'s loop fails 14 tests); float16 is the prelude's HIP path (``_Float16``). Grids come from
the native executor's own :func:`~batchgpu.executors.native.launch_grid` and launch checks, with
H100-like attributes except a small maximum grid, so that split grids run at small sizes. Kernels
without barriers run their threads as plain calls. Shared libraries are cached by source hash under the
pytest cache directory.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

import batchgpu as bg
from batchgpu import cuda_source
from batchgpu.executors.base import POISON_BYTE, Plan, Stats, plan_buffers
from batchgpu.executors.native import DeviceAttributes, check_native_launch
from batchgpu.executors.reference import ReferenceExecution, ReferenceExecutor
from batchgpu.kernels import Launch
from batchgpu.ops import Node
from batchgpu.scalars import SCALAR_BYTES, Scalar, uniform_bytes
from batchgpu.tensor import Storage

SMALL_GRID = DeviceAttributes(
    name="CPU emulation with a small grid",
    arch="sm_90",
    max_threads_per_block=1024,
    max_block_dim=(1024, 1024, 64),
    max_grid_dim=(4096, 1024, 1024),  # small, so split grids (blockIdx.y, gridDim.x) run at small sizes
    max_shared_memory_per_block=48 * 1024,
    max_shared_memory_per_block_optin=227 * 1024,
    warp_size=32,
    multiprocessor_count=1,
    total_memory=2**32,
)
"""SMALL_GRID-like limits except the grid: split grids are exercised at sizes the CPU can run quickly."""

EXECUTION_MODEL = r"""
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <type_traits>
#include <utility>
#define BG_HIP 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
struct bg_dim3 { unsigned x, y, z; };
static bg_dim3 blockIdx, threadIdx, blockDim, gridDim;
static float bg_cpu_dynamic_shared[(227 * 1024) / 4];
static bool bg_finished;
struct alignas(16) float4 { float x, y, z, w; };

// Coroutines for a block's threads. On x86-64 a switch saves the callee-saved registers on the
// running stack and swaps stack pointers (no signal-mask system call, unlike swapcontext: warp sums
// switch millions of times per decode step); elsewhere ucontext.
#if defined(__x86_64__)
asm(R"(
    .text
    .p2align 4
    .globl bg_cpu_switch
    .hidden bg_cpu_switch
bg_cpu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
)");
extern "C" __attribute__((visibility("hidden"))) void bg_cpu_switch(void** save, void* load);
static void* bg_scheduler;
static void** bg_running;  // the running thread's saved stack pointer slot; null: no coroutines
static void bg_start(void** slot, char* stack, size_t size, void (*entry)()) {
    void** top = (void**)(((size_t)(stack + size)) & ~(size_t)15);
    *--top = nullptr;         // entry's return address slot: entry starts as if called (rsp = 8 mod 16)
    *--top = (void*)entry;    // bg_cpu_switch's ret goes there
    for (int i = 0; i < 6; ++i) *--top = nullptr;  // rbp rbx r12-r15
    *slot = top;
}
static inline void bg_resume(void** slot) { bg_running = slot; bg_cpu_switch(&bg_scheduler, *slot); }
static inline void bg_yield() { bg_cpu_switch(bg_running, bg_scheduler); }
static inline void bg_exit() { void* dead; bg_cpu_switch(&dead, bg_scheduler); abort(); }
typedef void* bg_context;
#else
#include <ucontext.h>
static ucontext_t bg_scheduler;
static ucontext_t* bg_running;
static void bg_start(ucontext_t* context, char* stack, size_t size, void (*entry)()) {
    getcontext(context);
    context->uc_stack.ss_sp = stack;
    context->uc_stack.ss_size = size;
    context->uc_link = &bg_scheduler;
    makecontext(context, entry, 0);
}
static inline void bg_resume(ucontext_t* context) { bg_running = context; swapcontext(&bg_scheduler, context); }
static inline void bg_yield() { swapcontext(bg_running, &bg_scheduler); }
static inline void bg_exit() {}  // uc_link resumes the scheduler
typedef ucontext_t bg_context;
#endif

static inline void __syncthreads() {
    if (!bg_running) abort();  // a kernel flagged barrier-free called __syncthreads
    bg_yield();
}
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline float __fmul_rn(float x, float y) { return x * y; }  // C++ rounds each operation here
static inline float __fdiv_rn(float x, float y) { return x / y; }
static inline unsigned __float_as_uint(float x) { unsigned u; __builtin_memcpy(&u, &x, 4); return u; }
static inline float __uint_as_float(unsigned u) { float x; __builtin_memcpy(&x, &u, 4); return x; }
// A lane exchange as a block-wide step: every thread of the block must take part (bg_warp_sum's rule
// for a warp, made block-wide here). One barrier per exchange: the slots alternate between two sets, so
// the next exchange writes the other set, and the one after passes the next barrier first, which every
// thread reaches only after reading. Each thread counts its exchanges; bg_run zeroes the counts per block.
static unsigned bg_cpu_exchanges[1024];
template <typename T> static inline T __shfl_xor(T value, int mask) {
    static T slots[2][1024];
    const unsigned t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    T* set = slots[bg_cpu_exchanges[t]++ & 1u];
    set[t] = value;
    __syncthreads();
    return set[t ^ (unsigned)mask];
}
"""

LAUNCHER = r"""
template <class... A, size_t... I>
static void bg_invoke(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_reference_t<A>*>(args[I])...);
}
template <class... A>
static int bg_run(void (*kernel)(A...), const unsigned* grid, const unsigned* block, void** args, int barriers) {
    static void (*k)(A...);
    static void** a;
    k = kernel;
    a = args;
    const unsigned threads = block[0] * block[1] * block[2];
    const size_t stack = 256 * 1024;
    bg_context* contexts = (bg_context*)calloc(threads, sizeof(bg_context));
    char* stacks = (char*)malloc(stack * threads);
    bool* done = (bool*)calloc(threads, 1);
    if (!contexts || !stacks || !done) return 1;
    gridDim = {grid[0], grid[1], grid[2]};
    blockDim = {block[0], block[1], block[2]};
    struct Entry {
        static void run() {
            bg_invoke(k, a, std::index_sequence_for<A...>{});
            bg_finished = true;
            bg_exit();
        }
    };
    for (unsigned bz = 0; bz < grid[2]; ++bz)
    for (unsigned by = 0; by < grid[1]; ++by)
    for (unsigned bx = 0; bx < grid[0]; ++bx) {
        blockIdx = {bx, by, bz};
        const bool reverse_block = (bx + by + bz) & 1u;
        if (!barriers) {
            bg_running = nullptr;
            for (unsigned i = 0; i < threads; ++i) {
                const unsigned t = reverse_block ? threads - 1 - i : i;
                threadIdx = {t % block[0], (t / block[0]) % block[1], t / (block[0] * block[1])};
                bg_invoke(k, a, std::index_sequence_for<A...>{});
            }
            continue;
        }
        for (unsigned t = 0; t < threads; ++t) {
            bg_start(&contexts[t], stacks + stack * t, stack, Entry::run);
            done[t] = false;
            bg_cpu_exchanges[t] = 0;
        }
        // One round = every thread to its next barrier. Rounds alternate the thread order, so a read
        // of shared memory that another thread writes in the same phase (a missing __syncthreads)
        // sees different values in different rounds and blocks, and the results go wrong.
        for (unsigned remaining = threads, round = 0; remaining > 0; ++round) {
            for (unsigned i = 0; i < threads; ++i) {
                const unsigned t = ((round + bx + by + bz) & 1u) ? threads - 1 - i : i;
                if (done[t]) continue;
                threadIdx = {t % block[0], (t / block[0]) % block[1], t / (block[0] * block[1])};
                // returns at the thread's next __syncthreads(), or when it finishes
                bg_resume(&contexts[t]);
                if (bg_finished) { done[t] = true; --remaining; }
                bg_finished = false;
            }
        }
    }
    free(contexts); free(stacks); free(done);
    return 0;
}
"""


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")


def _prepare_source(source: str, entries: Sequence[str]) -> str:
    source = source.replace("extern __shared__ float bg_dynamic[];", "float* bg_dynamic = bg_cpu_dynamic_shared;")
    launchers = [
        f'extern "C" int bg_launch_{entry}(const unsigned* g, const unsigned* b, void** a, int barriers) '
        f"{{ return bg_run({entry}, g, b, a, barriers); }}"
        for entry in entries
    ]
    return EXECUTION_MODEL + source + LAUNCHER + "\n".join(launchers) + "\n"


def _has_barriers(launch: Launch) -> bool:
    """Whether the kernel may call __syncthreads (directly or through the prelude's bg_tree)."""
    body = launch.kernel.cuda if launch.kernel is not None else cuda_source.family_source(launch.family)
    return any(name in body for name in ("__syncthreads", "bg_tree", "bg_warp_sum"))


class Kernels:
    """Compiled shared libraries, one per kernel source, cached on disk by hash and in memory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self._libraries: dict[str, ctypes.CDLL] = {}
        self._lock = threading.Lock()

    def library(self, source: str, entries: Sequence[str]) -> ctypes.CDLL:
        program = _prepare_source(source, entries)
        key = hashlib.sha256(program.encode()).hexdigest()[:24]
        library = self._libraries.get(key)
        if library is None:
            path = self.root / f"{key}.so"
            if not path.exists():
                self._build(program, path)
            library = self._libraries[key] = ctypes.CDLL(str(path))
        return library

    def _build(self, program: str, path: Path) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            cpp = Path(tmp) / "kernel.cpp"
            cpp.write_text(program)
            out = Path(tmp) / "kernel.so"
            flags = ["-std=c++17", "-O1", "-shared", "-fPIC", "-w"]
            command = [compiler() or "g++", *flags, str(cpp), "-o", str(out)]
            built = subprocess.run(command, capture_output=True, text=True)
            if built.returncode:
                raise RuntimeError(f"g++ failed on a kernel source:\n{built.stderr[-3000:]}")
            os.replace(out, path)


class CpuPlan(Plan):
    def __init__(self, arrays: dict[Storage, np.ndarray], launches: list[tuple], scalars: tuple[Scalar, ...]) -> None:
        self.arrays = arrays
        self.launches = launches
        self.scalars = scalars
        self.scalar_bytes = np.zeros(SCALAR_BYTES, np.uint8)


class CudaOnCpuExecutor(ReferenceExecutor):
    """The executor protocol over CPU-compiled CUDA kernels (resident storages as in the reference)."""

    kind = "cuda-cpu"
    name = "CUDA kernels on the CPU (test harness)"

    def __init__(self, kernels: Kernels) -> None:
        super().__init__()
        self.kernels = kernels
        self.limits = SMALL_GRID.limits()
        self.stats = Stats()

    def form(self, launch: Launch) -> Launch:
        return launch.for_native()

    def prepare(self, launch: Launch) -> None:
        check_native_launch(self.form(launch), SMALL_GRID)

    def plan(
        self,
        nodes: Sequence[Node],
        storages: Sequence[Storage],
        scalars: Sequence[Scalar],
        *,
        aliases: Mapping[Storage, Storage] | None = None,
    ) -> CpuPlan:
        launches = [self.form(launch) for node in nodes for launch in node.launches]
        arrays = plan_buffers(  # byte arrays as device buffers; new output and scratch ones always poisoned
            storages,
            launches,
            aliases,
            allocate=lambda storage: np.zeros(-(-storage.nbytes // 4) * 4, np.uint8),
            resident=lambda storage: self._resident[storage].view(np.uint8),
            poison=lambda array: array.fill(POISON_BYTE),
        )
        plan = CpuPlan(arrays, [], tuple(scalars))
        plan.launches.extend(self._pack(launch, plan) for launch in launches)
        return plan

    def _pack(self, launch: Launch, plan: CpuPlan) -> tuple:
        grid, _ = check_native_launch(launch, SMALL_GRID)
        source, _ = cuda_source.render(launch)
        entry = cuda_source.entry_name(launch)
        function = getattr(self.kernels.library(source, [entry]), f"bg_launch_{entry}")
        slots: list = [ctypes.c_void_p(0) for _ in range(cuda_source.argument_count(launch))]
        for binding in launch.bindings:
            if binding.kind == "uniform":
                slots[binding.slot] = (ctypes.c_char * max(len(launch.params), 4)).from_buffer_copy(
                    launch.params.ljust(4, b"\0")
                )
            elif binding.kind == "scalars":
                slots[binding.slot] = ctypes.c_void_p(plan.scalar_bytes.ctypes.data)
            else:
                slots[binding.slot] = ctypes.c_void_p(plan.arrays[binding.storage].ctypes.data)
        args = (ctypes.c_void_p * max(len(slots), 1))(*(ctypes.addressof(s) for s in slots))
        dims = (ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*launch.workgroup_size)
        return launch.label, function, dims, args, slots, _has_barriers(launch)

    def run(
        self,
        plan: Plan,
        writes: Sequence[tuple[Storage, np.ndarray]],
        readback: Sequence[Storage],
        scalars: Mapping[str, int | float],
        **_: object,
    ) -> ReferenceExecution:
        assert isinstance(plan, CpuPlan)
        for storage, data in writes:
            raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
            plan.arrays[storage][: raw.nbytes] = raw
        if plan.scalars:
            packed = uniform_bytes(plan.scalars, scalars).ljust(SCALAR_BYTES, b"\0")
            plan.scalar_bytes[:] = np.frombuffer(packed, np.uint8)
        for label, function, (grid, block), args, _slots, barriers in plan.launches:
            if function(grid, block, args, barriers) != 0:
                raise MemoryError(f"{label}: the CPU harness could not allocate thread stacks")
            self.stats.dispatches += 1
        self.stats.submits += 1
        return ReferenceExecution({s: self.snapshot(plan, s) for s in readback})

    def snapshot(self, plan: Plan, storage: Storage) -> np.ndarray:
        assert isinstance(plan, CpuPlan)
        return plan.arrays[storage][: storage.nbytes].copy().view(storage.dtype)


def device(kernels: Kernels) -> bg.Device:
    """A Device whose executor runs the CUDA kernel sources on the CPU."""
    dev = bg.Device("reference")
    dev.executor = CudaOnCpuExecutor(kernels)
    dev.kind = "cuda-cpu"
    return dev
