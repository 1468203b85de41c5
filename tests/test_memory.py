"""``batch.outputs(...)``: declared outputs, intermediates sharing device buffers (batchgpu.memory)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import batchgpu as bg
from batchgpu.memory import lifetimes, share_buffers

from .conftest import assert_close, random_array


def mlp(dev: bg.Device, rng: np.random.Generator, layers: int = 6) -> tuple[bg.GpuCommandBatch, bg.Tensor, bg.Tensor]:
    """A chain of matmul + bias + relu + rms_norm layers (odd sizes); returns (batch, input, output)."""
    batch = bg.GpuCommandBatch(dev)
    x = batch.upload(random_array(rng, (7, 37), np.float32))
    h = x
    for _ in range(layers):
        w = dev.tensor(random_array(rng, (37, 37), np.float32) / 6)
        h = batch.rms_norm(batch.relu(batch.add(batch.matmul(h, w), 0.25)), dev.tensor(np.ones(37, np.float32)))
    return batch, x, batch.softmax(h)


@pytest.mark.parametrize("kind", ["gpu", "ref"])
def test_declared_outputs_share_buffers_and_keep_results(kind, request):
    dev = request.getfixturevalue(kind)
    batch, x, out = mlp(dev, np.random.default_rng(1))
    batch.execute()
    unshared = batch.read(out)
    assert batch.memory()["planned"] == batch.memory()["unshared"]
    batch.outputs(out)
    batch.execute()
    assert_close(batch.read(out), unshared)
    memory = batch.memory()
    assert memory["planned"] * 4 < memory["unshared"], memory
    new_input = random_array(np.random.default_rng(2), (7, 37), np.float32)
    batch.execute({x: new_input})  # re-execute the shared plan with new data
    assert_close(batch.read(x), new_input)  # inputs stay readable
    assert not np.allclose(batch.read(out), unshared)


def test_shared_plan_on_the_gpu_matches_the_reference(gpu, ref):
    results = []
    for dev in (gpu, ref):
        batch, _, out = mlp(dev, np.random.default_rng(3))
        if dev is gpu:  # the reference keeps a buffer per tensor: the ground truth
            batch.outputs(out)
        batch.execute()
        results.append(batch.read(out))
    assert_close(*results)


def test_reading_an_undeclared_intermediate_says_how_to_fix_it(gpu):
    batch = bg.GpuCommandBatch(gpu)
    x = batch.upload(random_array(np.random.default_rng(4), (5, 3), np.float32))
    middle = batch.exp(x)
    out = batch.sum(batch.mul(middle, 2.0), axis=1)
    batch.outputs(out)
    batch.execute()
    with pytest.raises(bg.BatchError, match=r"read: exp\d+ .* intermediate .* add it to batch\.outputs"):
        batch.read(middle)
    batch.outputs()  # no declaration: every tensor readable again, one buffer each ...
    with pytest.raises(bg.BatchError, match=r"read: exp\d+ .* intermediate"):
        batch.read(middle)  # ... after the next execute: the last one shared its buffer
    batch.execute()
    assert_close(batch.read(middle), np.exp(batch.read(x)))
    assert batch.memory()["planned"] == batch.memory()["unshared"]


def test_outputs_refuses_what_is_not_a_batch_tensor(gpu):
    batch = bg.GpuCommandBatch(gpu)
    other = bg.GpuCommandBatch(gpu).upload(np.ones(3, np.float32))
    with pytest.raises(bg.BatchError, match="outputs: expected Tensors, got ndarray"):
        batch.outputs(np.ones(3))
    with pytest.raises(bg.BatchError, match="outputs"):
        batch.outputs(other)
    with pytest.raises(bg.BatchError, match="is resident"):
        batch.outputs(gpu.tensor(np.ones(3, np.float32)))


def test_state_written_in_place_survives_executes(gpu, ref):
    """A KV cache made with ``batch.empty`` and updated by kv_write keeps its rows from one execute to
    the next: storages read before their producer writes them never share a buffer."""
    rng = np.random.default_rng(5)
    steps = [random_array(rng, (1, 2, 8), np.float32) for _ in range(3)]
    query = random_array(rng, (1, 4, 8), np.float32)
    results = []
    for dev in (gpu, ref):
        batch = bg.GpuCommandBatch(dev)
        pos = batch.scalar("pos")
        new = batch.upload(steps[0])
        k = batch.kv_write(batch.empty((8, 2, 8)), new, pos)
        v = batch.kv_write(batch.empty((8, 2, 8)), batch.mul(new, 0.5), pos)
        attended = batch.attention(batch.upload(query), k, v, pos=pos)
        out = batch.tanh(batch.mul(attended, 2.0))  # intermediates after the caches' last use
        if dev is gpu:  # the reference keeps a buffer per tensor: the ground truth
            batch.outputs(out)
        for position, step in enumerate(steps):
            batch.execute({new: step}, scalars={"pos": position})
        results.append(batch.read(out))
    assert_close(*results)


def test_members_of_a_shared_buffer_never_overlap_in_time(ref):
    batch, _, out = mlp(ref, np.random.default_rng(6), layers=9)
    diamond = batch.add(batch.exp(out), batch.tanh(out))  # two live branches
    batch.outputs(diamond)
    nodes, storages = list(batch.nodes), list(batch.view().storages)
    spans = lifetimes(nodes, {diamond.storage})
    plan = share_buffers(nodes, storages, {diamond.storage})
    groups: dict = {}
    for storage, shared in plan.aliases.items():
        groups.setdefault(shared, []).append(storage)
    assert groups, "nothing was shared"
    for shared, members in groups.items():
        assert shared.nbytes == max(m.nbytes for m in members)
        ordered = sorted(members, key=lambda m: spans[m][0])
        for before, after in itertools.pairwise(ordered):
            assert spans[before][1] < spans[after][0], (before, spans[before], after, spans[after])
    assert diamond.storage in plan.storages and diamond.storage not in plan.aliases
