"""The native executor's ctypes tables checked against the vendors' own headers, with no GPU.

A C++ compiler reads NVIDIA's ``cuda.h`` (from the ``nvidia-cuda-runtime`` wheel in the ``test``
extra) and AMD's ``hip/hip_runtime_api.h`` (Debian's ``libamdhip64-dev``) and prints, for every
function of the driver table, the size and class (integer/pointer vs floating point) of its return
value and of each parameter, and the value of every enum constant the executor hard-codes. The test
compares them with the ctypes argtypes and the Python constants: a wrong arity, a 4-byte int where the
API takes a size_t, a misspelt or missing symbol, or a wrong attribute number fails here rather than
on the first GPU run. ``decltype`` keeps the functions unevaluated, so nothing links to libcuda.
Against the real ``libamdhip64`` (ROCm 5.2 on Debian 12) every symbol must also resolve, and
``Device("hip")`` must fail with the driver's own error on a machine without an AMD GPU.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import batchgpu as bg
from batchgpu.errors import DeviceError, UnsupportedError
from batchgpu.executors import native

# generic attribute name -> (CUdevice_attribute, hipDeviceAttribute_t)
ATTRIBUTE_NAMES = {
    "max_threads_per_block": ("CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK", "hipDeviceAttributeMaxThreadsPerBlock"),
    "max_block_dim_x": ("CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X", "hipDeviceAttributeMaxBlockDimX"),
    "max_block_dim_y": ("CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y", "hipDeviceAttributeMaxBlockDimY"),
    "max_block_dim_z": ("CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z", "hipDeviceAttributeMaxBlockDimZ"),
    "max_grid_dim_x": ("CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X", "hipDeviceAttributeMaxGridDimX"),
    "max_grid_dim_y": ("CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y", "hipDeviceAttributeMaxGridDimY"),
    "max_grid_dim_z": ("CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z", "hipDeviceAttributeMaxGridDimZ"),
    "max_shared_memory_per_block": (
        "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK",
        "hipDeviceAttributeMaxSharedMemoryPerBlock",
    ),
    "warp_size": ("CU_DEVICE_ATTRIBUTE_WARP_SIZE", "hipDeviceAttributeWarpSize"),
    "multiprocessor_count": ("CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT", "hipDeviceAttributeMultiprocessorCount"),
    "compute_capability_major": (
        "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR",
        "hipDeviceAttributeComputeCapabilityMajor",
    ),
    "compute_capability_minor": (
        "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR",
        "hipDeviceAttributeComputeCapabilityMinor",
    ),
    "max_shared_memory_per_block_optin": (
        "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN",
        "hipDeviceAttributeSharedMemPerBlockOptin",
    ),
}
# Python constant -> (CUDA name, HIP name); None where the constant is CUDA-only
CONSTANT_NAMES = {
    "FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES": ("CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES", None),
    "STREAM_NON_BLOCKING": ("CU_STREAM_NON_BLOCKING", "hipStreamNonBlocking"),
    "EVENT_DISABLE_TIMING": ("CU_EVENT_DISABLE_TIMING", "hipEventDisableTiming"),
    "CAPTURE_MODE_THREAD_LOCAL": ("CU_STREAM_CAPTURE_MODE_THREAD_LOCAL", "hipStreamCaptureModeThreadLocal"),
    "NOT_READY": ("CUDA_ERROR_NOT_READY", "hipErrorNotReady"),
    "POINTER_ATTRIBUTE_DEVICE_ORDINAL": ("CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL", None),
}

PRINTER = """
#include <cstdio>
#include <type_traits>
template <class T> void bg_describe() {
    std::printf(" %zu%c", sizeof(T), std::is_floating_point<T>::value ? 'f' : 'x');
}
template <class F> struct bg_signature;
template <class R, class... A> struct bg_signature<R(A...)> {
    static void print(const char* name) {
        std::printf("fn %s", name);
        bg_describe<R>();
        (bg_describe<A>(), ...);
        std::printf("\\n");
    }
};
"""


def _compiler() -> str:
    found = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++") or shutil.which("clang++")
    if not found:
        pytest.skip("no C++ compiler (apt-get install g++) to read the vendor headers")
    return found


def _cuda_include() -> Path:
    candidates = [Path(os.environ["CUDA_HOME"]) / "include"] if os.environ.get("CUDA_HOME") else []
    for entry in sys.path:
        candidates += [Path(entry) / "nvidia" / "cu13" / "include", Path(entry) / "nvidia" / "cuda_runtime" / "include"]
    candidates.append(Path("/usr/local/cuda/include"))
    for candidate in candidates:
        if (candidate / "cuda.h").is_file():
            return candidate
    pytest.skip("cuda.h not found (pip install nvidia-cuda-runtime, in the test extra)")


def _hip_include() -> Path:
    for root in (os.environ.get("ROCM_PATH", "/opt/rocm"), "/usr"):
        if (Path(root) / "include" / "hip" / "hip_runtime_api.h").is_file():
            return Path(root) / "include"
    pytest.skip("hip/hip_runtime_api.h not found (apt-get install libamdhip64-dev)")


def _ctypes_class(argtype) -> str:
    size = ctypes.sizeof(argtype)
    return f"{size}{'f' if argtype in (ctypes.c_float, ctypes.c_double) else 'x'}"


def _expected_and_program(vendor: str, header_text: str) -> tuple[dict[str, list[str]], dict[str, int], str]:
    """What the ctypes tables say (per symbol: return then argument classes; per enum: value) and
    the C++ program that prints what the header says."""
    column = 0 if vendor == "cuda" else 1
    signatures: dict[str, list[str]] = {}
    for symbols_and_args in native.FUNCTIONS.values():
        symbol, argtypes = symbols_and_args[column], symbols_and_args[2]
        signatures[symbol] = ["4x", *(_ctypes_class(t) for t in argtypes)]
    for symbol, argtypes, restype in (native.CUDA_ONLY if vendor == "cuda" else native.HIP_ONLY).values():
        if symbol == "hipGetDevicePropertiesR0600" and symbol not in header_text:
            symbol = "hipGetDeviceProperties"  # ROCm 5: the executor falls back to this name
        signatures[symbol] = [_ctypes_class(restype or ctypes.c_int), *(_ctypes_class(t) for t in argtypes)]
    enums = {names[column]: native.ATTRIBUTES[generic][column] for generic, names in ATTRIBUTE_NAMES.items()}
    enums |= {names[column]: getattr(native, constant) for constant, names in CONSTANT_NAMES.items() if names[column]}
    header = "#include <cuda.h>" if vendor == "cuda" else "#include <hip/hip_runtime_api.h>"
    lines = [header, PRINTER, "int main() {"]
    lines += [f'    bg_signature<decltype({symbol})>::print("{symbol}");' for symbol in signatures]
    lines += [f'    std::printf("enum {name} %d\\n", (int){name});' for name in enums]
    lines.append("}")
    return signatures, enums, "\n".join(lines)


def _run_against_header(vendor: str, include: Path, tmp_path: Path) -> None:
    header = include / ("cuda.h" if vendor == "cuda" else "hip/hip_runtime_api.h")
    signatures, enums, program = _expected_and_program(vendor, header.read_text(errors="replace"))
    source = tmp_path / f"{vendor}_abi.cpp"
    source.write_text(program)
    binary = tmp_path / f"{vendor}_abi"
    # HIP: the AMD platform, without the C++ template overloads of hipMalloc/hipHostMalloc
    defines = ["-D__HIP_PLATFORM_AMD__", "-D__HIP_DISABLE_CPP_FUNCTIONS__"] if vendor == "hip" else []
    build = subprocess.run(
        [_compiler(), "-std=c++17", *defines, f"-I{include}", str(source), "-o", str(binary)],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, f"the {vendor} table names something {header} lacks:\n{build.stderr[-4000:]}"
    printed = subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout.splitlines()
    actual_signatures = {line.split()[1]: line.split()[2:] for line in printed if line.startswith("fn ")}
    actual_enums = {line.split()[1]: int(line.split()[2]) for line in printed if line.startswith("enum ")}
    wrong = [
        f"{symbol}: ctypes (return, args) {signatures[symbol]} vs header {actual_signatures[symbol]}"
        for symbol in signatures
        if signatures[symbol] != actual_signatures[symbol]
    ]
    wrong += [
        f"{name} = {enums[name]} in the table, {actual_enums[name]} in {header.name}"
        for name in enums
        if enums[name] != actual_enums[name]
    ]
    assert not wrong, "\n".join(wrong)


def test_owning_objects_free_through_checked_rows():
    """Modules, events and graph executables are freed by their owning objects (executors/native/) with
    rows of the table, so the header comparisons below check those signatures too."""
    for vendor, symbols in {
        "cuda": ("cuModuleUnload", "cuEventDestroy_v2", "cuGraphExecDestroy"),
        "hip": ("hipModuleUnload", "hipEventDestroy", "hipGraphExecDestroy"),
    }.items():
        signatures = _expected_and_program(vendor, "")[0]
        pointer = _ctypes_class(ctypes.c_void_p)
        assert all(signatures[symbol] == ["4x", pointer] for symbol in symbols), vendor


def test_cuda_table_matches_cuda_h(tmp_path):
    _run_against_header("cuda", _cuda_include(), tmp_path)


def test_hip_table_matches_hip_runtime_api_h(tmp_path):
    _run_against_header("hip", _hip_include(), tmp_path)


def _hip_driver() -> native.Driver:
    try:
        return native.Driver("hip")
    except UnsupportedError as exc:
        pytest.skip(f"{exc} (apt-get install libamdhip64-5)")


def test_every_hip_symbol_resolves_in_libamdhip64():
    driver = _hip_driver()
    assert driver.missing == []
    assert driver.error_string(600).startswith("hipErrorNotReady")


def test_hip_device_without_an_amd_gpu_fails_with_the_driver_error():
    driver = _hip_driver()
    count = ctypes.c_int(-1)
    status = driver.device_count(ctypes.byref(count))
    if status == 0 and count.value > 0:
        pytest.skip(f"this machine has {count.value} AMD GPU(s): tests/test_native_ops.py runs on them")
    with pytest.raises(DeviceError, match=r"hip: init .*failed: hipError\w+: .*\(status \d+\)"):
        bg.Device("hip")
