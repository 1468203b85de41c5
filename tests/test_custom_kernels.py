"""Custom WGSL kernels: ``batch.launch(Kernel(...), grid, buffers, scalars)`` on wgpu and, through the
kernel's numpy ``reference``, on the reference executor; launch validation against queried limits."""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator

import numpy as np
import pytest

import batchgpu as bg

from .conftest import assert_close, random_array

SAXPY = """
struct Params { a: f32, n: u32 }
@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@group(0) @binding(2) var<uniform> p: Params;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i < p.n) {
        y[i] = p.a * x[i] + y[i];
    }
}
"""


SAXPY_CUDA = """
struct Params { float a; unsigned n; };
extern "C" __global__ void saxpy(float* x, float* y, const Params p) {
    unsigned i = bg_thread_index();
    if (i < p.n) y[i] = p.a * x[i] + y[i];
}
"""


def saxpy_reference(x: np.ndarray, y: np.ndarray, a: float, n: int) -> None:
    y[:n] = np.float32(a) * x[:n] + y[:n]


def saxpy_kernel(**kwargs) -> bg.Kernel:
    kwargs = {"cuda": SAXPY_CUDA, "cuda_entry": "saxpy", **kwargs}
    return bg.Kernel(wgsl=SAXPY, entry="main", name="saxpy", reference=saxpy_reference, **kwargs)


# out[row, col] = x[row, col] * x[row, col] + b over a 2-D grid of 8x8 workgroups; T is f32 or i32
SQUARE_PLUS = """
struct Params { b: T, rows: u32, cols: u32 }
@group(0) @binding(0) var<storage, read_write> x: array<T>;
@group(0) @binding(1) var<storage, read_write> out: array<T>;
@group(0) @binding(2) var<uniform> p: Params;

@compute @workgroup_size(8, 8)
fn square_plus(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x < p.cols && gid.y < p.rows) {
        let i = gid.y * p.cols + gid.x;
        out[i] = x[i] * x[i] + p.b;
    }
}
"""


def square_plus_reference(x: np.ndarray, out: np.ndarray, b, rows: int, cols: int) -> None:
    out[...] = x * x + x.dtype.type(b)


SQUARE_PLUS_CUDA = """
struct Params { T b; unsigned rows, cols; };
extern "C" __global__ void square_plus(T* x, T* out, const Params p) {
    unsigned col = blockIdx.x * blockDim.x + threadIdx.x, row = blockIdx.y * blockDim.y + threadIdx.y;
    if (col < p.cols && row < p.rows) {
        unsigned i = row * p.cols + col;
        out[i] = x[i] * x[i] + p.b;
    }
}
"""


def square_plus_kernel(dtype: np.dtype) -> bg.Kernel:
    floating = np.dtype(dtype) == np.float32
    wgsl = f"alias T = {'f32' if floating else 'i32'};\n" + SQUARE_PLUS
    cuda = f"typedef {'float' if floating else 'int'} T;\n" + SQUARE_PLUS_CUDA
    return bg.Kernel(wgsl=wgsl, entry="square_plus", reference=square_plus_reference, cuda=cuda)


@pytest.fixture(params=["gpu", "ref"])
def dev(request: pytest.FixtureRequest) -> bg.Device:
    return request.getfixturevalue(request.param)


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def record_saxpy(
    batch: bg.GpuCommandBatch, rng: np.random.Generator, n: int, kernel: bg.Kernel | None = None
) -> tuple[bg.Tensor, bg.Tensor, np.ndarray, np.ndarray, float]:
    xa, ya = random_array(rng, (n,), np.float32), random_array(rng, (n,), np.float32)
    a = float(rng.uniform(0.5, 2.0))
    x, y = batch.upload(xa, name="x"), batch.upload(ya, name="y")
    batch.launch(kernel or saxpy_kernel(), math.ceil(n / 64), buffers=[x, y], scalars=[a, np.uint32(n)])
    return x, y, xa, ya, a


@contextlib.contextmanager
def fails(batch: bg.GpuCommandBatch, error: type[bg.BatchError], *fragments: str) -> Iterator[None]:
    """Expect exactly ``error`` with every fragment in its message, raised at record time without
    compiling, allocating, uploading or submitting anything, and without recording the launch."""
    before = batch.device.stats.snapshot()
    ops = len(batch)
    with pytest.raises(bg.BatchError) as info:
        yield
    assert type(info.value) is error, f"expected {error.__name__}, got {type(info.value).__name__}: {info.value}"
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} missing from {info.value}"
    after = batch.device.stats.snapshot()
    for counter in ("pipelines_compiled", "buffers_created", "bytes_uploaded", "submits", "dispatches"):
        assert after[counter] == before[counter], (counter, before[counter], after[counter], str(info.value))
    assert len(batch) == ops


def assert_batch_works(batch: bg.GpuCommandBatch, rng: np.random.Generator) -> None:
    """The batch records and executes a saxpy plus a built-in op, with correct results."""
    x, y, xa, ya, a = record_saxpy(batch, rng, 257)
    total = batch.add(y, x)
    batch.execute()
    expected = np.float32(a) * xa + ya
    assert_close(batch.read(y), expected)
    assert_close(batch.read(total), expected + xa)


# running kernels -------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 257, 4099])
def test_saxpy_matches_numpy(dev: bg.Device, rng: np.random.Generator, n: int) -> None:
    batch = bg.GpuCommandBatch(dev)
    x, y, xa, ya, a = record_saxpy(batch, rng, n)
    batch.execute()
    assert_close(batch.read(y), np.float32(a) * xa + ya)
    assert_close(batch.read(x), xa)  # bound read_write, left as it was


@pytest.mark.asyncio
async def test_saxpy_async(gpu: bg.Device, rng: np.random.Generator) -> None:
    batch = bg.GpuCommandBatch(gpu)
    _, y, xa, ya, a = record_saxpy(batch, rng, 4099)
    await batch.execute_async()
    assert_close(await batch.read_async(y), np.float32(a) * xa + ya)


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_kernel_writes_into_empty(dev: bg.Device, rng: np.random.Generator, dtype) -> None:
    rows, cols = 19, 37  # not multiples of the 8x8 workgroup
    batch = bg.GpuCommandBatch(dev)
    xa = random_array(rng, (rows, cols), dtype)
    b = float(rng.uniform(-3, 3)) if dtype == np.float32 else int(rng.integers(-50, -1))
    x = batch.upload(xa)
    out = batch.empty((rows, cols), dtype, name="out")
    grid = (math.ceil(cols / 8), math.ceil(rows / 8))
    batch.launch(square_plus_kernel(dtype), grid, buffers=[x, out], scalars=[b, rows, cols])
    batch.execute()
    assert_close(batch.read(out), xa * xa + np.dtype(dtype).type(b))


def test_kernel_mixed_with_builtin_ops_is_one_submit(dev: bg.Device, rng: np.random.Generator) -> None:
    n = 1000
    xa, ya = random_array(rng, (n,), np.float32), random_array(rng, (n,), np.float32)
    a = 1.25
    batch = bg.GpuCommandBatch(dev)
    x, y = batch.upload(xa), batch.upload(ya)
    product = batch.mul(x, y)  # built-in, feeds the kernel
    acc = batch.copy(y)  # built-in output the kernel updates in place
    batch.launch(saxpy_kernel(), math.ceil(n / 64), buffers=[product, acc], scalars=[a, n])
    result = batch.sub(acc, x)  # built-in consuming the kernel's output

    def expected(xa: np.ndarray, ya: np.ndarray) -> np.ndarray:
        return np.float32(a) * (xa * ya) + ya - xa

    launches = sum(len(node.launches) for node in batch.nodes)
    before = dev.stats.snapshot()
    batch.execute()
    assert_close(batch.read(result), expected(xa, ya))
    after = dev.stats.snapshot()
    assert after["submits"] - before["submits"] == 1
    if dev is not None and dev.kind == "wgpu":
        assert after["dispatches"] - before["dispatches"] == launches == 4

    for _ in range(2):  # re-execute with new inputs: one submit each, nothing compiled
        xa, ya = random_array(rng, (n,), np.float32), random_array(rng, (n,), np.float32)
        before = dev.stats.snapshot()
        batch.execute({x: xa, y: ya})
        assert_close(batch.read(result), expected(xa, ya))
        after = dev.stats.snapshot()
        assert after["submits"] - before["submits"] == 1
        assert after["pipelines_compiled"] == before["pipelines_compiled"]
    assert_close(batch.read(acc), np.float32(a) * (xa * ya) + ya)


def test_reexecute_and_second_batch_compile_nothing(gpu: bg.Device, rng: np.random.Generator) -> None:
    first = bg.GpuCommandBatch(gpu)
    x, y, xa, ya, a = record_saxpy(first, rng, 300)
    doubled = first.mul(y, 2.0)
    first.execute()  # built-in pipelines compile on the first execute, custom kernels at launch()
    assert_close(first.read(doubled), (np.float32(a) * xa + ya) * np.float32(2))
    compiled = gpu.stats.pipelines_compiled
    for _ in range(3):
        xa, ya = random_array(rng, (300,), np.float32), random_array(rng, (300,), np.float32)
        first.execute({x: xa, y: ya})
        assert_close(first.read(doubled), (np.float32(a) * xa + ya) * np.float32(2))
    assert gpu.stats.pipelines_compiled == compiled

    # the same kernel, and an equal one built from the same source, in new batches of other sizes
    for kernel in (saxpy_kernel(), saxpy_kernel()):
        second = bg.GpuCommandBatch(gpu)
        _, y2, xa2, ya2, a2 = record_saxpy(second, rng, 4099, kernel)
        doubled2 = second.mul(y2, 2.0)
        second.execute()
        assert_close(second.read(doubled2), (np.float32(a2) * xa2 + ya2) * np.float32(2))
        assert gpu.stats.pipelines_compiled == compiled


# errors ----------------------------------------------------------------------------------------


def test_wgsl_compile_error(gpu: bg.Device, rng: np.random.Generator) -> None:
    batch = bg.GpuCommandBatch(gpu)
    x, y, _, _, _ = record_saxpy(batch, rng, 65)
    broken = bg.Kernel(wgsl=SAXPY.replace("p.a * x[i]", "p.a * xs[i]"), name="broken_saxpy")
    for _ in range(2):  # a failed compile is not cached as a success
        with fails(batch, bg.CompileError, "broken_saxpy", "xs", "identifier"):
            batch.launch(broken, 2, buffers=[x, y], scalars=[1.0, 65])
    wrong_entry = bg.Kernel(wgsl=SAXPY, entry="saxpy_main", name="entryless")
    with fails(batch, bg.CompileError, "entryless", "saxpy_main"):
        batch.launch(wrong_entry, 2, buffers=[x, y], scalars=[1.0, 65])
    assert_batch_works(batch, rng)


def _limit_kernel(workgroup: str = "64", extra: str = "", buffers: int = 1) -> str:
    bindings = "".join(f"@group(0) @binding({i}) var<storage, read_write> b{i}: array<f32>;\n" for i in range(buffers))
    body = "".join(f"    b{i}[0] = b{i}[0] + 1.0;\n" for i in range(buffers))
    return f"{bindings}{extra}\n@compute @workgroup_size({workgroup})\nfn main() {{\n{body}}}\n"


def _limit_cases(limits: bg.Limits) -> dict[str, tuple[bg.Kernel, object, int, int, str, int]]:
    """name: (kernel, grid, buffer count, scalar count, limit name, offending value)."""
    x_max, y_max, z_max = (
        limits.max_compute_workgroup_size_x,
        limits.max_compute_workgroup_size_y,
        limits.max_compute_workgroup_size_z,
    )
    per_dim = limits.max_compute_workgroups_per_dimension
    invocations = limits.max_compute_invocations_per_workgroup
    wide = min(x_max, invocations)
    tall = invocations // wide + 1
    assert tall <= y_max, "cannot exceed invocations without exceeding a dimension on this device"
    cells = limits.max_compute_workgroup_storage_size // 4 * 2
    scratch = f"var<workgroup> big: array<f32, {cells}>;\nfn touch() {{ big[0] = 1.0; }}"
    buffers = limits.max_storage_buffers_per_shader_stage + 1
    scalars = limits.max_uniform_buffer_binding_size // 4 + 1
    return {
        "workgroup_size_x": (
            bg.Kernel(_limit_kernel(f"{x_max + 1}")),
            1,
            1,
            0,
            "max_compute_workgroup_size_x",
            x_max + 1,
        ),
        "workgroup_size_y": (
            bg.Kernel(_limit_kernel(f"1, {y_max + 1}")),
            1,
            1,
            0,
            "max_compute_workgroup_size_y",
            y_max + 1,
        ),
        "workgroup_size_z": (
            bg.Kernel(_limit_kernel(f"1, 1, {z_max + 1}")),
            1,
            1,
            0,
            "max_compute_workgroup_size_z",
            z_max + 1,
        ),
        "workgroup_size_argument": (  # a size the source spells as an expression is taken from the argument
            bg.Kernel(_limit_kernel("64u * 1u"), workgroup_size=(x_max + 1,)),
            1,
            1,
            0,
            "max_compute_workgroup_size_x",
            x_max + 1,
        ),
        "workgroup_size_override": (  # an override constant's default value is the size
            bg.Kernel(_limit_kernel("WG", extra=f"override WG: u32 = {x_max + 1}u;")),
            1,
            1,
            0,
            "max_compute_workgroup_size_x",
            x_max + 1,
        ),
        "invocations": (
            bg.Kernel(_limit_kernel(f"{wide}, {tall}")),
            1,
            1,
            0,
            "max_compute_invocations_per_workgroup",
            wide * tall,
        ),
        "grid_x": (
            bg.Kernel(_limit_kernel()),
            per_dim + 1,
            1,
            0,
            "max_compute_workgroups_per_dimension (x)",
            per_dim + 1,
        ),
        "grid_y": (
            bg.Kernel(_limit_kernel()),
            (1, per_dim + 1),
            1,
            0,
            "max_compute_workgroups_per_dimension (y)",
            per_dim + 1,
        ),
        "grid_z": (
            bg.Kernel(_limit_kernel()),
            (1, 1, per_dim + 1),
            1,
            0,
            "max_compute_workgroups_per_dimension (z)",
            per_dim + 1,
        ),
        "workgroup_storage": (
            bg.Kernel(_limit_kernel(extra=scratch)),
            1,
            1,
            0,
            "max_compute_workgroup_storage_size",
            cells * 4,
        ),
        "storage_buffers": (
            bg.Kernel(_limit_kernel(buffers=buffers)),
            1,
            buffers,
            0,
            "max_storage_buffers_per_shader_stage",
            buffers,
        ),
        "uniform_size": (
            bg.Kernel(_limit_kernel()),
            1,
            1,
            scalars,
            "max_uniform_buffer_binding_size",
            -(-scalars * 4 // 16) * 16,
        ),
    }


LIMIT_CASES = [
    "workgroup_size_x",
    "workgroup_size_y",
    "workgroup_size_z",
    "workgroup_size_argument",
    "workgroup_size_override",
    "invocations",
    "grid_x",
    "grid_y",
    "grid_z",
    "workgroup_storage",
    "storage_buffers",
    "uniform_size",
]


@pytest.mark.parametrize("case", LIMIT_CASES)
def test_launch_over_device_limit(gpu: bg.Device, rng: np.random.Generator, case: str) -> None:
    kernel, grid, buffer_count, scalar_count, limit_name, actual = _limit_cases(gpu.limits)[case]
    allowed = getattr(gpu.limits, limit_name.split(" ")[0])
    batch = bg.GpuCommandBatch(gpu)
    buffers = [batch.upload(random_array(rng, (4,), np.float32)) for _ in range(buffer_count)]
    scalars = [float(v) for v in rng.uniform(1, 2, scalar_count)]
    with fails(batch, bg.LimitError, f"launch {kernel.name}", limit_name, f"{actual} > {allowed}"):
        batch.launch(kernel, grid, buffers=buffers, scalars=scalars)
    assert_batch_works(batch, rng)


def test_same_tensor_twice(dev: bg.Device, rng: np.random.Generator) -> None:
    batch = bg.GpuCommandBatch(dev)
    x, y, _, _, _ = record_saxpy(batch, rng, 100)
    with fails(batch, bg.BatchError, "saxpy", "buffers[1]", "buffers[0]", "same storage"):
        batch.launch(saxpy_kernel(), 2, buffers=[x, x], scalars=[1.0, 100])
    view = batch.reshape(y, 10, 10)  # a view shares its storage
    with fails(batch, bg.BatchError, "saxpy", "buffers[1]", "buffers[0]", "same storage"):
        batch.launch(saxpy_kernel(), 2, buffers=[y, view], scalars=[1.0, 100])
    assert_batch_works(batch, rng)


def test_bad_launch_arguments(dev: bg.Device, rng: np.random.Generator) -> None:
    batch = bg.GpuCommandBatch(dev)
    x, y, _, _, _ = record_saxpy(batch, rng, 100)
    kernel = saxpy_kernel()
    with fails(batch, bg.ArgumentError, "launch", "Kernel", "str"):
        batch.launch(SAXPY, 2, buffers=[x, y], scalars=[1.0, 100])
    with fails(batch, bg.ArgumentError, "launch", "buffers[1]", "float"):
        batch.launch(kernel, 2, buffers=[x, 2.0], scalars=[1.0, 100])
    with fails(batch, bg.ArgumentError, "launch", "buffers[0]", "ndarray"):
        batch.launch(kernel, 2, buffers=[np.ones(100, np.float32), y], scalars=[1.0, 100])
    with fails(batch, bg.ArgumentError, "saxpy", "scalars[1]", "'100'"):
        batch.launch(kernel, 2, buffers=[x, y], scalars=[1.0, "100"])
    with fails(batch, bg.ArgumentError, "saxpy", "scalars[0]", "True"):
        batch.launch(kernel, 2, buffers=[x, y], scalars=[True, 100])
    with fails(batch, bg.DTypeError, "saxpy", "scalars[1]", str(2**40), "u32"):
        batch.launch(kernel, 2, buffers=[x, y], scalars=[1.0, 2**40])
    with fails(batch, bg.DTypeError, "saxpy", "scalars[1]", "i32"):
        batch.launch(kernel, 2, buffers=[x, y], scalars=[1.0, -(2**31) - 1])
    with fails(batch, bg.DTypeError, "saxpy", "scalars[0]", "f32"):
        batch.launch(kernel, 2, buffers=[x, y], scalars=[1e39, 100])
    with fails(batch, bg.ArgumentError, "saxpy", "scalars", "list"):
        batch.launch(kernel, 2, buffers=[x, y], scalars=1.0)
    with fails(batch, bg.LimitError, "saxpy", "grid", "below 1"):
        batch.launch(kernel, 0, buffers=[x, y], scalars=[1.0, 100])
    with fails(batch, bg.LimitError, "saxpy", "grid", "1 to 3"):
        batch.launch(kernel, (1, 1, 1, 1), buffers=[x, y], scalars=[1.0, 100])
    with fails(batch, bg.LimitError, "saxpy", "grid", "2.5"):
        batch.launch(kernel, 2.5, buffers=[x, y], scalars=[1.0, 100])
    with fails(batch, bg.LimitError, "saxpy", "grid", "(2, 1.0)"):
        batch.launch(kernel, (2, 1.0), buffers=[x, y], scalars=[1.0, 100])
    other = bg.GpuCommandBatch(dev, name="elsewhere")
    stranger = other.upload(random_array(rng, (100,), np.float32), name="stranger")
    with fails(batch, bg.DeviceMismatchError, "launch", "buffers[1]", "stranger", "elsewhere"):
        batch.launch(kernel, 2, buffers=[x, stranger], scalars=[1.0, 100])
    assert_batch_works(batch, rng)


def test_reference_executor_needs_reference_fn(ref: bg.Device, gpu: bg.Device, rng: np.random.Generator) -> None:
    bare = bg.Kernel(wgsl=SAXPY, entry="main", name="bare_saxpy")
    batch = bg.GpuCommandBatch(ref)
    _, y, xa, ya, a = record_saxpy(batch, rng, 257)  # with a reference fn: runs
    batch.execute()
    assert_close(batch.read(y), np.float32(a) * xa + ya)
    record_saxpy(batch, rng, 257, bare)  # recording works: nothing runs yet
    with pytest.raises(bg.UnsupportedError, match=r"bare_saxpy.*reference"):
        batch.execute()
    with pytest.raises(bg.NotExecutedError, match=r"last execute\(\) of batch .* failed"):
        batch.read(y)
    assert_batch_works(bg.GpuCommandBatch(ref), rng)  # the device is fine
    on_gpu = bg.GpuCommandBatch(gpu)  # and wgpu runs the same kernel without a reference
    _, y2, xa2, ya2, a2 = record_saxpy(on_gpu, rng, 257, bare)
    on_gpu.execute()
    assert_close(on_gpu.read(y2), np.float32(a2) * xa2 + ya2)
