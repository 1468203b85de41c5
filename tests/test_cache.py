"""The cache directory and the fast wgpu import: a second process finds the pipelines of the first
(counted in ``dev.stats``), the parsed wgpu header, and the driver's shader cache under
``$BATCHGPU_CACHE_DIR``; the fast cffi type lookup gives exactly what cffi's parser gives."""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

from batchgpu import cache, coldstart

ROOT = Path(__file__).resolve().parents[1]

FIRST_RESULT = """
import json, sys
import numpy as np
import batchgpu as bg
from batchgpu import coldstart
sys.path.insert(0, sys.argv[1])
from ffn_layer import make_weights, record_ffn

dev = bg.Device("wgpu")
rng = np.random.default_rng(0)
weights = [{k: dev.tensor(v) for k, v in layer.items()} for layer in make_weights(rng, 1, 32, 48)]
batch = bg.GpuCommandBatch(dev)
x = batch.upload(rng.standard_normal((4, 32)).astype(np.float32))
y = batch.softmax(record_ffn(batch, x, weights))
batch.execute()
batch.read(y)
print(json.dumps({"stats": dev.stats.snapshot(), "coldstart": coldstart.stats, "device": dev.name}))
"""


def python_env(**extra: str) -> dict[str, str]:
    """The current environment with the checkout first on the path (works installed or not)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MESA_SHADER_CACHE_DIR", "BATCHGPU_CACHE_DIR")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(extra)
    return env


def first_result(cache_dir: Path | str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", FIRST_RESULT, str(ROOT / "examples")],
        env=python_env(BATCHGPU_CACHE_DIR=str(cache_dir)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_second_process_compiles_fewer_pipelines(tmp_path):
    first = first_result(tmp_path)
    second = first_result(tmp_path)
    built = first["stats"]["pipelines_compiled"]
    assert built >= 4  # matmul, silu, binary, softmax
    assert first["stats"]["pipeline_cache_misses"] == built and first["stats"]["pipeline_cache_hits"] == 0
    # wgpu-py exposes no pipeline cache: every process creates its pipelines through wgpu, but the
    # second one finds them all built before, with their driver code in the cache dir
    assert second["stats"]["pipelines_compiled"] == built
    assert second["stats"]["pipeline_cache_misses"] == 0 < first["stats"]["pipeline_cache_misses"]
    assert second["stats"]["pipeline_cache_hits"] == built
    assert first["coldstart"]["header_cache"] == "miss" and second["coldstart"]["header_cache"] == "hit"
    assert first["coldstart"]["fast_types"] > 10
    index = list((tmp_path / "pipelines").glob("*.txt"))
    assert len(index) == 1 and len(index[0].read_text().split()) == built
    assert list((tmp_path / "cffi").glob("header-*.pickle"))
    if "llvmpipe" in first["device"]:  # Mesa: its shader cache was pointed into the cache dir
        assert any(p.is_file() for p in (tmp_path / "mesa").rglob("*"))


def test_cache_dir_off_writes_nothing(tmp_path):
    home_cache = tmp_path / "xdg"
    done = subprocess.run(
        [sys.executable, "-c", FIRST_RESULT, str(ROOT / "examples")],
        env=python_env(BATCHGPU_CACHE_DIR="off", XDG_CACHE_HOME=str(home_cache)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["stats"]["pipeline_cache_hits"] == 0
    assert not (home_cache / "batchgpu").exists()  # (Mesa may keep its own default cache there)


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHGPU_CACHE_DIR", str(tmp_path / "here"))
    assert cache.cache_dir() == tmp_path / "here"
    monkeypatch.setenv("BATCHGPU_CACHE_DIR", "off")
    assert cache.cache_dir() is None and cache.subdir("x") is None
    monkeypatch.delenv("BATCHGPU_CACHE_DIR")
    if sys.platform.startswith("linux"):
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        assert cache.cache_dir() == tmp_path / "xdg" / "batchgpu"


HIP_KERNEL = 'extern "C" __global__ void add_one(float* x) { x[threadIdx.x] += 1.0f; }'


def test_kernel_modules_follow_the_cache_dir(monkeypatch, tmp_path):
    """NVRTC/hipRTC modules live in <cache dir>/kernels, the one cache dir of batchgpu.cache; with
    BATCHGPU_CACHE_DIR=off nothing is read or written (not a folder named "off" in the working dir)."""
    from batchgpu.nvrtc import ModuleCache

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BATCHGPU_CACHE_DIR", str(tmp_path / "here"))
    assert ModuleCache().path == tmp_path / "here" / "kernels"
    ModuleCache().put("key", b"module bytes")
    assert ModuleCache().get("key") == b"module bytes"
    monkeypatch.setenv("BATCHGPU_CACHE_DIR", "off")
    off = ModuleCache()
    assert off.path is None and off.get("key") is None
    off.put("other", b"module bytes")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here"]
    assert ModuleCache(tmp_path / "explicit").path == tmp_path / "explicit" / "kernels"  # a root given: used


def test_hiprtc_with_the_cache_dir_off_compiles_every_time_and_writes_nothing(monkeypatch, tmp_path):
    from batchgpu.errors import UnsupportedError
    from batchgpu.nvrtc import Hiprtc

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BATCHGPU_CACHE_DIR", "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    try:
        hiprtc = Hiprtc()
    except UnsupportedError as exc:
        pytest.skip(f"hipRTC cannot be loaded (apt-get install libamdhip64-5 libhiprtc-builtins5): {exc}")
    codes = [hiprtc.compile(HIP_KERNEL, "add_one.cu", "gfx90a", target="code") for _ in range(2)]
    assert all(code[:4] == b"\x7fELF" for code in codes)
    assert hiprtc.compiled == 2  # no disk cache to read back
    assert list(tmp_path.iterdir()) == []


def test_pipeline_index_round_trip(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHGPU_CACHE_DIR", str(tmp_path))
    index = cache.PipelineIndex("adapter A")
    key = cache.PipelineIndex.key("source", "main", ())
    assert key not in index
    index.add([key, key])
    assert key in cache.PipelineIndex("adapter A")
    assert key not in cache.PipelineIndex("adapter B")  # another adapter or driver starts empty
    assert index.path.read_text().split() == [key]


def test_header_cache_refuses_foreign_pickles():
    evil = pickle.dumps(os.getcwd)  # anything outside cffi.model must not be loaded
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        coldstart._ModelUnpickler(io.BytesIO(evil)).load()


def wgpu_type_strings() -> set[str]:
    """Every string literal in wgpu-py's native backend that looks like a simple C type or a callback
    signature of simple types."""
    import wgpu.backends.wgpu_native as native

    found: set[str] = set()
    for source in Path(native.__file__).parent.glob("*.py"):
        for literal in re.findall(r'"([^"\n]{1,200})"', source.read_text()):
            if coldstart._SIMPLE_TYPE.match(literal) or coldstart._FUNCTION_TYPE.match(literal):
                found.add(literal)
    return found


def test_fast_type_lookup_equals_cffi_parser():
    from cffi import model
    from cffi.commontypes import resolve_common_type
    from cffi.cparser import Parser

    wgpu = coldstart.import_wgpu()
    parser = wgpu.backends.wgpu_native._ffi.ffi._parser
    strings = wgpu_type_strings() | {
        "uint8_t[]",
        "uint32_t *",
        "void *",
        "const char *",
        "char const *",
        "int32_t[4]",
        "float",
        "WGPUBufferDescriptor *",
        "WGPUChainedStruct * ",
        "const WGPUFeatureName *",
    }
    checked = functions = 0
    for cdecl in sorted(strings):
        fast = coldstart.fast_type(parser, cdecl, model, resolve_common_type)
        if fast is None:
            continue
        slow = Parser.parse_type_and_quals(parser, cdecl)  # cffi's own, unpatched
        assert fast == slow, cdecl
        assert type(fast[0]) is type(slow[0]), cdecl
        checked += 1
        functions += isinstance(fast[0], model.RawFunctionType)
    assert checked >= 30 and functions >= 5  # the callbacks wgpu-py declares are among them
    for not_simple in (
        "unsigned int",
        "struct WGPUChainedStruct *",
        "void(*)(int)",
        "long",
        "WGPUNoSuchType *",
        "void(int, ...)",
        "void(void, int)",
        "void(WGPUNoSuchType)",
    ):
        assert coldstart.fast_type(parser, not_simple, model, resolve_common_type) is None, not_simple
