"""DLPack and __cuda_array_interface__ interop (batchgpu/interop.py, Device.tensor, Tensor.__dlpack__).

CPU paths run everywhere: the reference device's resident tensors are host memory exported as
kDLCPU, so numpy's own DLPack consumer (np.from_dlpack) exercises the capsule code, and numpy's own
producer (ndarray.__dlpack__) exercises the parser. Device-memory paths (torch/CuPy CUDA tensors into
Device("cuda") and back) are at the end and skip, naming why, without a CUDA device, torch or CuPy.
"""

from __future__ import annotations

import ctypes
import gc
import weakref

import numpy as np
import pytest

import batchgpu as bg
from batchgpu import interop
from batchgpu.errors import ExportError
from batchgpu.interop import (
    KDL_CPU,
    KDL_CUDA,
    KDL_ROCM,
    KDL_WEBGPU,
    DLDataType,
    foreign_array,
    foreign_device,
    parse_capsule,
    parse_cuda_array_interface,
    to_dlpack_capsule,
)

from .conftest import native_device_or_skip, random_array

DTYPES = [np.float32, np.float16, np.int32, np.uint32]
SHAPES = [(), (1,), (7,), (13, 5), (3, 5, 7), (2, 1, 11)]


class Owner:
    """A weak-referenceable object standing for the memory's owner in capsule lifetime checks."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array


class HostProducer:
    """A DLPack producer of host memory through to_dlpack_capsule (versioned when asked)."""

    def __init__(self, array: np.ndarray, owner: object) -> None:
        self.array, self.owner = array, owner

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        versioned = max_version is not None and max_version[0] >= 1
        a = self.array
        return to_dlpack_capsule(a.ctypes.data, a.shape, a.dtype, KDL_CPU, 0, self.owner, versioned=versioned)

    def __dlpack_device__(self):
        return (KDL_CPU, 0)


class DeviceClaim:
    """An object that says its memory is on a GPU (DLPack device query only); __dlpack__ must not be
    reached by code that refuses such memory."""

    def __init__(self, device: tuple[int, int]) -> None:
        self.device = device

    def __dlpack__(self, **kwargs):
        raise AssertionError("__dlpack__ was called; the device check should have refused first")

    def __dlpack_device__(self):
        return self.device


# --- export from the reference device (host memory, kDLCPU) through our capsule code ------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_reference_tensor_round_trips_through_numpy_from_dlpack(ref, dtype, shape):
    rng = np.random.default_rng(sum(shape) + 7)
    x = random_array(rng, shape, dtype)
    t = ref.tensor(x)
    assert t.__dlpack_device__() == (KDL_CPU, 0)
    y = np.from_dlpack(t)  # numpy asks for a versioned capsule (max_version=(1, 0))
    assert y.dtype == x.dtype and y.shape == x.shape
    np.testing.assert_array_equal(y, x)
    legacy = parse_capsule(t.__dlpack__())  # the 0.x "dltensor" capsule, read back by our parser
    with legacy:
        assert (legacy.shape, legacy.dtype, legacy.device_type) == (x.shape, x.dtype, KDL_CPU)
        assert legacy.pointer == y.ctypes.data  # both views of the one resident array
    # zero copy: Device.write updates the resident array in place, and the exported view sees it
    x2 = random_array(rng, shape, dtype)
    ref.write(t, x2)
    np.testing.assert_array_equal(y, x2)
    np.testing.assert_array_equal(ref.read(t), x2)


def test_copy_true_exports_an_independent_copy(ref):
    rng = np.random.default_rng(3)
    x = random_array(rng, (17, 3), np.float32)
    t = ref.tensor(x)
    copied = np.from_dlpack(t, copy=True)
    shared = np.from_dlpack(t)
    assert copied.ctypes.data != shared.ctypes.data
    ref.write(t, x * 3)
    np.testing.assert_array_equal(copied, x)
    np.testing.assert_array_equal(shared, x * 3)


def test_dl_device_other_than_ours_is_refused(ref):
    t = ref.tensor(np.arange(1, 5, dtype=np.float32))
    with pytest.raises(BufferError, match="dl_device"):
        t.__dlpack__(dl_device=(KDL_CUDA, 0))
    assert np.from_dlpack(t, device="cpu").shape == (4,)


def test_resident_tensor_of_another_device_is_host_data_for_the_host_path(ref):
    x = random_array(np.random.default_rng(5), (6, 4), np.int32)
    other = bg.Device("reference")
    t = other.tensor(ref.tensor(x))  # kDLCPU DLPack object without __array__: read via np.from_dlpack
    np.testing.assert_array_equal(other.read(t), x)


def test_reference_tensor_has_no_cuda_array_interface(ref):
    t = ref.tensor(np.ones(3, np.float32) * 2)
    assert not hasattr(t, "__cuda_array_interface__")


# --- foreign_array on host data --------------------------------------------------------------------


def test_foreign_array_of_host_data_is_none(ref):
    x = random_array(np.random.default_rng(1), (4, 4), np.float32)
    producer = HostProducer(x, Owner(x))
    for data in (x, x[::2], [1.0, 2.0], 3.5, producer, ref.tensor(x)):
        assert foreign_device(data) is None
        assert foreign_array(data) is None
    assert interop.live_exports() == 0  # nothing was exported: foreign_array(producer) never called __dlpack__


def test_foreign_device_reads_the_query_without_consuming():
    assert foreign_device(DeviceClaim((KDL_CUDA, 1))) == (KDL_CUDA, 1)
    assert foreign_device(DeviceClaim((KDL_ROCM, 0))) == (KDL_ROCM, 0)

    class CaiOnly:
        __cuda_array_interface__ = cai(shape=(2,))

    assert foreign_device(CaiOnly()) == (KDL_CUDA, None)


# --- __cuda_array_interface__ parsing (no driver involved) -------------------------------------------


def cai(**entries):
    base = {"shape": (4, 6), "typestr": "<f4", "data": (0x7F0000001000, False), "version": 3}
    base.update(entries)
    return {k: v for k, v in base.items() if v is not ...}


def test_cuda_array_interface_parses_shape_dtype_pointer_and_stream():
    owner = object()
    a = parse_cuda_array_interface(cai(stream=7, strides=None), owner=owner)
    assert (a.pointer, a.shape, a.dtype, a.strides, a.stream) == (0x7F0000001000, (4, 6), np.dtype(np.float32), None, 7)
    assert (a.device_type, a.device_id, a.readonly, a.protocol) == (KDL_CUDA, None, False, "cuda_array_interface")
    assert a.contiguous and a.nbytes == 96 and a.owner is owner
    a.release()
    assert a.owner is None
    b = parse_cuda_array_interface(cai(typestr="<u4", data=(0x1000, True), version=2, stream=5))
    assert b.dtype == np.uint32 and b.readonly and b.stream is None  # no stream entry before version 3
    half = parse_cuda_array_interface(cai(typestr="<f2", shape=(3,)))
    assert half.dtype == np.float16 and half.nbytes == 6


def test_cuda_array_interface_strides_decide_contiguity():
    assert parse_cuda_array_interface(cai(strides=(24, 4))).contiguous  # explicit row-major strides
    assert not parse_cuda_array_interface(cai(strides=(4, 16))).contiguous  # a transpose (column-major)
    assert not parse_cuda_array_interface(cai(strides=(48, 4))).contiguous  # every other row
    assert parse_cuda_array_interface(cai(shape=(1, 6), strides=(999, 4))).contiguous  # extent 1: any stride
    float64 = parse_cuda_array_interface(cai(typestr="<f8"))
    assert float64.dtype == np.float64  # parsed; Device.tensor refuses it with the supported list


@pytest.mark.parametrize(
    "entries, error, match",
    [
        (dict(mask={"shape": (4, 6)}), BufferError, "mask"),
        (dict(version=1), BufferError, "version 1"),
        (dict(version=...), BufferError, "version None"),
        (dict(data=...), BufferError, "'data'"),
        (dict(data=(0, False)), BufferError, "null data pointer"),
        (dict(data=12345), BufferError, "pointer, readonly"),
        (dict(stream=0), BufferError, "stream 0"),
        (dict(typestr=">f4"), bg.DTypeError, "byte order"),
        (dict(typestr="<x9"), bg.DTypeError, "not a dtype"),
        (dict(strides=(4,)), bg.ShapeError, "do not match"),
        (dict(shape=(-1, 6)), bg.ShapeError, "negative"),
    ],
)
def test_cuda_array_interface_errors(entries, error, match):
    with pytest.raises(error, match=match):
        parse_cuda_array_interface(cai(**entries))


def test_cuda_array_interface_must_be_a_dict():
    with pytest.raises(TypeError, match="must be a dict"):
        parse_cuda_array_interface([("shape", (1,))])


# --- DLPack capsule parsing, on numpy's own capsules --------------------------------------------------


@pytest.mark.parametrize("max_version", [None, (1, 0)], ids=["dltensor", "dltensor_versioned"])
@pytest.mark.parametrize(
    "view",
    [
        lambda a: a,
        lambda a: a[1::2, ::3],  # non-contiguous slice with an offset
        lambda a: a.T,  # column-major
        lambda a: a.reshape(4, 3, 5)[:, 1:, :],
    ],
    ids=["contiguous", "strided_slice", "transpose", "3d_slice"],
)
def test_parse_capsule_matches_numpy(view, max_version):
    base = random_array(np.random.default_rng(11), (12, 5), np.float32)
    arr = view(base)
    capsule = arr.__dlpack__(max_version=max_version) if max_version else arr.__dlpack__()
    name = b"dltensor_versioned" if max_version else b"dltensor"
    assert interop._capsule_is_valid(capsule, name)
    a = parse_capsule(capsule)
    assert interop._capsule_is_valid(capsule, b"used_" + name)  # marked consumed, per the spec
    assert a.pointer == arr.ctypes.data
    assert a.shape == arr.shape and a.dtype == arr.dtype
    assert a.strides == arr.strides or (a.strides is None and arr.flags.c_contiguous)
    assert a.contiguous == arr.flags.c_contiguous
    assert (a.device_type, a.device_id) == (KDL_CPU, 0)
    # the pointer is really the data: read it back through ctypes, honouring the strides
    strides = a.strides or arr.strides
    raw = np.lib.stride_tricks.as_strided(
        np.frombuffer((ctypes.c_char * (arr.size * 64)).from_address(a.pointer), np.float32, count=1),
        a.shape,
        strides,
    )
    np.testing.assert_array_equal(raw, arr)
    a.release()
    a.release()  # idempotent: the deleter runs once


def test_parse_capsule_reads_every_dtype_and_readonly_flag():
    for dtype in (*DTYPES, np.float64, np.int64, np.int8, np.complex64):
        arr = random_array(np.random.default_rng(2), (3,), np.float32).astype(dtype)
        with parse_capsule(arr.__dlpack__()) as a:
            assert a.dtype == np.dtype(dtype)
    frozen = np.arange(1, 5, dtype=np.int32)
    frozen.flags.writeable = False
    with parse_capsule(frozen.__dlpack__(max_version=(1, 0))) as a:
        assert a.readonly


def test_parse_capsule_release_frees_the_producer_array():
    arr = random_array(np.random.default_rng(4), (1000,), np.float32)
    alive = weakref.ref(arr)
    a = parse_capsule(arr.__dlpack__(max_version=(1, 0)))
    del arr
    gc.collect()
    assert alive() is not None  # the capsule's manager keeps numpy's array while we read it
    a.release()
    gc.collect()
    assert alive() is None
    arr = random_array(np.random.default_rng(4), (10,), np.float32)
    alive = weakref.ref(arr)
    parse_capsule(arr.__dlpack__())  # never released explicitly: collected, the finalizer calls the deleter
    del arr
    gc.collect()
    assert alive() is None


def test_parse_capsule_refuses_used_and_foreign_capsules():
    arr = np.arange(1, 4, dtype=np.float32)
    capsule = arr.__dlpack__()
    parse_capsule(capsule).release()
    with pytest.raises(BufferError, match="unconsumed DLPack capsule"):
        parse_capsule(capsule)
    with pytest.raises(BufferError, match="unconsumed DLPack capsule"):
        parse_capsule(object())


def test_dlpack_dtypes_without_numpy_equivalent_are_named():
    with pytest.raises(bg.DTypeError, match=r"bfloat16 is not supported \(expected one of float32, float16"):
        interop.dlpack_dtype(DLDataType(interop.KDL_BFLOAT, 16, 1))
    with pytest.raises(bg.DTypeError, match="4 lanes"):
        interop.dlpack_dtype(DLDataType(interop.KDL_FLOAT, 32, 4))
    with pytest.raises(bg.DTypeError, match="code 9"):
        interop.dlpack_dtype(DLDataType(9, 8, 1))


# --- capsule lifetime: no leak, no double free --------------------------------------------------------


def test_ten_thousand_capsules_free_every_owner():
    rng = np.random.default_rng(8)
    refs = []
    for i in range(10_000):
        x = random_array(rng, (i % 5 + 1,), np.float32)
        owner = Owner(x)
        refs.append(weakref.ref(owner))
        producer = HostProducer(x, owner)
        del owner
        kind = i % 4
        if kind == 0:  # numpy consumes a versioned capsule and calls the deleter when y dies
            y = np.from_dlpack(producer)
            np.testing.assert_array_equal(y, x)
            assert refs[-1]() is not None  # the consumer's array keeps the owner alive
            del y
        elif kind == 1:  # our own consumer, legacy capsule
            a = parse_capsule(producer.__dlpack__())
            assert a.pointer == x.ctypes.data
            a.release()
        elif kind == 2:  # dropped unconsumed: released by the next export's sweep
            producer.__dlpack__(max_version=(1, 0))
        else:  # refused by the consumer (numpy reads no CUDA memory): its own error, not a SystemError
            capsule = to_dlpack_capsule(x.ctypes.data, x.shape, x.dtype, KDL_CUDA, 0, producer.owner, versioned=True)
            # numpy < 2.5 raises RuntimeError, 2.5 BufferError
            with pytest.raises((RuntimeError, BufferError), match=r"[Uu]nsupported device"):
                np.from_dlpack(_Returns(capsule, (KDL_CUDA, 0)))
            del capsule
        del producer
    assert interop.live_exports() == 0  # sweeps the unconsumed ones
    gc.collect()
    alive = sum(r() is not None for r in refs)
    assert alive == 0, f"{alive} of 10000 capsule owners were never released"


class _Returns:
    def __init__(self, capsule, device):
        self.capsule, self.device = capsule, device

    def __dlpack__(self, **kwargs):
        capsule, self.capsule = self.capsule, None
        return capsule

    def __dlpack_device__(self):
        return self.device


def test_unconsumed_capsule_keeps_its_owner_until_dropped():
    x = np.arange(1, 9, dtype=np.float32)
    owner = Owner(x)
    alive = weakref.ref(owner)
    capsule = HostProducer(x, owner).__dlpack__()
    del owner
    gc.collect()
    assert interop.live_exports() == 1 and alive() is not None
    del capsule
    assert interop.live_exports() == 0 and alive() is None


# --- errors: wgpu, batch and quantized tensors, device arrays on the wrong device ----------------------


def test_wgpu_tensors_cannot_be_exported(gpu):
    t = gpu.tensor(random_array(np.random.default_rng(9), (8,), np.float32))
    assert t.__dlpack_device__() == (KDL_WEBGPU, 0)
    with pytest.raises(ExportError, match=r"cannot be shared.*Device\.read") as info:
        t.__dlpack__()
    assert isinstance(info.value, BufferError)
    with pytest.raises(BufferError):
        np.from_dlpack(t)
    assert not hasattr(t, "__cuda_array_interface__")
    assert interop.live_exports() == 0


def test_batch_tensors_cannot_be_exported(ref, gpu):
    for device in (ref, gpu):
        batch = bg.GpuCommandBatch(device)
        t = batch.upload(np.arange(1, 7, dtype=np.float32))
        with pytest.raises(ExportError, match=r"batch tensor.*batch\.read\(t\)"):
            t.__dlpack__()
        with pytest.raises(bg.BatchError, match="batch tensor"):
            np.from_dlpack(t)


def test_quantized_tensors_cannot_be_exported(ref):
    raw = np.random.default_rng(6).integers(1, 255, 2 * 34, dtype=np.uint8)  # two q8_0 blocks
    w = ref.quantized(raw, "q8_0", (2, 32))
    with pytest.raises(ExportError, match="packed q8_0 blocks"):
        w.__dlpack__()


@pytest.mark.parametrize("claim", [(KDL_CUDA, 0), (KDL_ROCM, 0), (KDL_WEBGPU, 0)])
def test_device_arrays_for_host_only_devices_say_what_to_do(ref, gpu, claim):
    for device in (ref, gpu):
        with pytest.raises(bg.DeviceMismatchError, match=r"copy it to the host first \(torch: t\.cpu\(\)\.numpy\(\)"):
            device.tensor(DeviceClaim(claim))

    class CaiOnly:
        __cuda_array_interface__ = cai()

    with pytest.raises(bg.DeviceMismatchError, match=r"CUDA memory.*cupy\.asnumpy"):
        ref.tensor(CaiOnly())


def test_resident_tensor_given_to_another_device_is_copied_through_the_host(ref, gpu):
    t = gpu.tensor(np.arange(1, 4, dtype=np.float32))
    copied = ref.tensor(t)
    assert copied.device is ref
    np.testing.assert_array_equal(ref.read(copied), [1, 2, 3])
    np.testing.assert_array_equal(gpu.read(gpu.tensor(copied)), [1, 2, 3])
    batch = bg.GpuCommandBatch(gpu)
    with pytest.raises(bg.ArgumentError, match=r"batch tensor.*batch.read"):
        ref.tensor(batch.upload(np.ones(2, np.float32)))


# --- device memory: torch / CuPy on Device("cuda") (skip without a CUDA device) -------------------------


@pytest.fixture
def cuda() -> bg.Device:
    return native_device_or_skip("cuda")


@pytest.mark.parametrize("dtype", ["float32", "float16", "int32"])
def test_torch_cuda_tensor_round_trip(cuda, dtype):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    src = (torch.randn(37, 5, device="cuda") * 100).to(getattr(torch, dtype))
    t = cuda.tensor(src)
    expected = src.cpu().numpy()
    np.testing.assert_array_equal(cuda.read(t), expected)
    src.add_(1)  # a copy: later producer writes do not reach the resident tensor
    np.testing.assert_array_equal(cuda.read(t), expected)
    back = torch.from_dlpack(t)
    assert back.device.type == "cuda" and back.dtype == src.dtype
    np.testing.assert_array_equal(back.cpu().numpy(), expected)
    batch = bg.GpuCommandBatch(cuda)
    if dtype != "int32":
        out = batch.mul(t, 2.0)
        batch.execute()
        np.testing.assert_allclose(batch.read(out), expected * 2, rtol=1e-3)


def test_torch_cuda_errors(cuda):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    with pytest.raises(bg.ShapeError, match="contiguous"):
        cuda.tensor(torch.randn(8, 6, device="cuda").T)
    for bad in (torch.float64, torch.int64, torch.bfloat16):
        with pytest.raises(bg.DTypeError, match="float32, float16, int32, uint32"):
            cuda.tensor(torch.randn(4, device="cuda").to(bad))
    assert interop.live_exports() == 0


def test_cupy_round_trip(cuda):
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    src = cupy.asarray(random_array(np.random.default_rng(12), (19, 3), np.float32))
    t = cuda.tensor(src)
    np.testing.assert_array_equal(cuda.read(t), cupy.asnumpy(src))
    back = cupy.from_dlpack(t)
    np.testing.assert_array_equal(cupy.asnumpy(back), cupy.asnumpy(src))
    via_cai = cupy.asarray(t)  # __cuda_array_interface__
    np.testing.assert_array_equal(cupy.asnumpy(via_cai), cupy.asnumpy(src))
