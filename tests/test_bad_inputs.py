"""Bad inputs beyond tests/test_errors.py (issue 7): NaN/inf data propagates exactly like numpy on both
executors (never crashing; docs/reliability.md: "NaN and inf"); wrong per-execute scalar names and types; every
public method of a released batch. After each error the same batch and device run a correct batch."""

from __future__ import annotations

import numpy as np
import pytest

import batchgpu as bg
from batchgpu.ops.elementwise import EXPRESSIONS

from .test_errors import Probe, new_batch, rng  # noqa: F401 - rng is a fixture

X = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.5, -2.0, 1e30], np.float32)
Y = np.array([1.0, np.nan, 2.0, np.inf, -np.inf, np.nan, 0.0, -1.0], np.float32)


def _unary(op: str):
    return lambda b, x, y: getattr(b, op)(x)


def _binary(op: str):
    return lambda b, x, y: getattr(b, op)(x, y)


CASES = {op: _unary(op) if row.arity == 1 else _binary(op) for op, row in EXPRESSIONS.items()}
CASES.update(
    {
        "sum": lambda b, x, y: b.sum(b.reshape(x, (2, 4)), axis=1),
        "mean": lambda b, x, y: b.mean(b.reshape(x, (2, 4)), axis=1),
        "max": lambda b, x, y: b.max(b.reshape(x, (2, 4)), axis=1),
        "softmax": lambda b, x, y: b.softmax(b.reshape(x, (2, 4))),
        "matmul": lambda b, x, y: b.matmul(b.reshape(x, (2, 4)), b.reshape(y, (4, 2))),
        "cast16": lambda b, x, y: b.cast(x, np.float16),
        "transpose": lambda b, x, y: b.transpose(b.reshape(x, (2, 4))),
    }
)


def _classes(a: np.ndarray) -> tuple[np.ndarray, ...]:
    return np.isnan(a), np.isposinf(a), np.isneginf(a)


@pytest.mark.parametrize("op", sorted(CASES))
def test_nan_and_inf_propagate_like_numpy(gpu: bg.Device, ref: bg.Device, op: str) -> None:
    results = []
    for dev in (gpu, ref):
        batch = bg.GpuCommandBatch(dev)
        tx, ty = batch.upload(X), batch.upload(Y)
        out = CASES[op](batch, tx, ty)
        with np.errstate(all="ignore"):
            batch.execute()
        results.append(batch.read(out))
        # the same batch then runs finite data correctly
        finite = np.linspace(0.5, 2.0, 8, dtype=np.float32)
        with np.errstate(all="ignore"):
            batch.execute({tx: finite, ty: finite[::-1].copy()})
        assert np.isfinite(batch.read(out)).all()
    got, want = results
    for g, w in zip(_classes(got), _classes(want)):
        np.testing.assert_array_equal(g, w, err_msg=f"{op}: gpu {got} vs numpy {want}")


@pytest.fixture(params=["gpu", "ref"])
def dev(request: pytest.FixtureRequest) -> bg.Device:
    return request.getfixturevalue(request.param)


BAD_SCALARS = [
    ({"nope": 1}, bg.BatchError, "nope"),
    ({"pos": -1}, bg.BatchError, "pos"),
    ({"pos": 1.5}, bg.BatchError, "pos"),
    ({"pos": "3"}, bg.BatchError, "pos"),
]


@pytest.mark.parametrize(("scalars", "error", "fragment"), BAD_SCALARS)
def test_wrong_scalar_names_and_types(dev: bg.Device, rng, scalars, error, fragment) -> None:  # noqa: F811
    batch, probe = new_batch(dev, rng)
    pos = batch.scalar("pos", "u32", 0)
    cache = batch.upload(np.zeros((4, 1, 2), np.float32))
    batch.kv_write(cache, batch.upload(np.ones((1, 1, 2), np.float32)), pos)
    batch.execute(scalars={"pos": 2})
    with pytest.raises(error, match=fragment):
        batch.execute(scalars=scalars)
    probe.check()
    with pytest.raises(bg.BatchError, match="pos"):
        batch.scalar("pos")  # declared twice
    with pytest.raises(bg.DTypeError, match="f64"):
        batch.scalar("other", "f64")
    probe.check()


def test_every_public_method_of_a_released_batch(dev: bg.Device, rng) -> None:  # noqa: F811
    _, probe = new_batch(dev, rng)
    doomed = bg.GpuCommandBatch(dev, name="gone")
    x = doomed.upload(np.ones((2, 2), np.float32))
    y = doomed.neg(x)
    doomed.execute()
    doomed.release()
    calls = {
        "upload": lambda: doomed.upload(np.ones(2, np.float32)),
        "empty": lambda: doomed.empty(2),
        "scalar": lambda: doomed.scalar("s"),
        "execute": lambda: doomed.execute(),
        "read": lambda: doomed.read(y),
        "launch": lambda: doomed.launch(bg.Kernel(wgsl="", entry="main"), 1, buffers=[x]),
    }
    for name in ["neg", "abs", "exp", "relu", "copy", "softmax", "transpose", "sum", "max", "mean"]:
        calls[name] = (lambda f: lambda: f(doomed, x, x))(_unary(name))
    for name in ["add", "sub", "mul", "div", "maximum", "minimum", "matmul"]:
        calls[name] = (lambda f: lambda: f(doomed, x, x))(_binary(name))
    calls["cast"] = lambda: doomed.cast(x, "int32")
    calls["reshape"] = lambda: doomed.reshape(x, 4)
    calls["slice"] = lambda: doomed.slice(x, 0)
    calls["concat"] = lambda: doomed.concat([x, x])
    for call in calls.values():
        with pytest.raises(bg.BatchError, match=r"released|gone"):
            call()
    probe.check()
    assert isinstance(probe, Probe)
