"""Batch semantics on the real wgpu device: one submit per execute, the pipeline cache, re-execution
with new inputs, readback staging reuse, async reads that yield to the event loop."""

from __future__ import annotations

import asyncio
import gc

import numpy as np
import psutil
import pytest

import batchgpu as bg

from .conftest import counting_event_loop_ticks, random_array


def small_layer(batch: bg.GpuCommandBatch, x: bg.Tensor, w: bg.Tensor, b: bg.Tensor) -> bg.Tensor:
    return batch.relu(batch.add(batch.matmul(x, w), b))


@pytest.fixture()
def layer_data():
    rng = np.random.default_rng(20)
    return (
        random_array(rng, (5, 7), np.float32),
        random_array(rng, (7, 3), np.float32),
        random_array(rng, (3,), np.float32),
    )


def test_execute_is_one_submit_whatever_the_op_count(gpu):
    rng = np.random.default_rng(21)
    x = random_array(rng, (33,), np.float32)
    batch = bg.GpuCommandBatch(gpu, fusion=False)  # 200 dispatches (fused by default, the chain is one)
    t = batch.upload(x)
    expected = x.copy()
    for i in range(200):
        t = batch.add(t, 1.0) if i % 2 == 0 else batch.mul(t, 0.5)
        expected = expected + np.float32(1.0) if i % 2 == 0 else expected * np.float32(0.5)
    before = gpu.stats.snapshot()
    batch.execute()
    after = gpu.stats.snapshot()
    assert after["submits"] - before["submits"] == 1
    assert after["dispatches"] - before["dispatches"] == 200
    out = batch.read(t)  # the readback copy rode in that submit: reading adds none
    assert gpu.stats.submits == after["submits"]
    np.testing.assert_allclose(out, expected, rtol=1e-5)


def test_reexecute_with_new_inputs_compiles_nothing(gpu, layer_data):
    x, w, b = layer_data
    batch = bg.GpuCommandBatch(gpu)
    tx = batch.upload(x)
    y = small_layer(batch, tx, gpu.tensor(w), gpu.tensor(b))
    batch.execute()
    np.testing.assert_allclose(batch.read(y), np.maximum(x @ w + b, 0), rtol=1e-5, atol=1e-6)
    compiled = gpu.stats.pipelines_compiled
    for scale in (2.0, -1.0, 3.5):
        submits = gpu.stats.submits
        batch.execute({tx: (x * scale).astype(np.float32)})
        np.testing.assert_allclose(batch.read(y), np.maximum((x * scale) @ w + b, 0), rtol=1e-5, atol=1e-5)
        assert gpu.stats.submits == submits + 1
    assert gpu.stats.pipelines_compiled == compiled


def test_same_ops_in_a_new_batch_compile_nothing(gpu, layer_data):
    x, w, b = layer_data
    first = bg.GpuCommandBatch(gpu)
    y1 = small_layer(first, first.upload(x), gpu.tensor(w), gpu.tensor(b))
    first.execute()
    first.read(y1)
    compiled = gpu.stats.pipelines_compiled
    second = bg.GpuCommandBatch(gpu)
    y2 = small_layer(second, second.upload(x * 2), gpu.tensor(w), gpu.tensor(b))
    second.execute()
    np.testing.assert_allclose(second.read(y2), np.maximum((x * 2) @ w + b, 0), rtol=1e-5, atol=1e-5)
    assert gpu.stats.pipelines_compiled == compiled


def test_bind_groups_and_buffers_are_built_once(gpu, layer_data):
    x, w, b = layer_data
    batch = bg.GpuCommandBatch(gpu)
    tx = batch.upload(x)
    y = small_layer(batch, tx, gpu.tensor(w), gpu.tensor(b))
    batch.execute()
    batch.read(y)
    plan = batch.view().plan
    created = gpu.stats.buffers_created
    for _ in range(5):
        batch.execute({tx: x})
        batch.read(y)
    assert batch.view().plan is plan
    assert gpu.stats.buffers_created == created


def test_weights_stay_resident_across_batches(gpu, layer_data):
    x, w, b = layer_data
    tw, tb = gpu.tensor(w), gpu.tensor(b)
    uploaded = gpu.stats.bytes_uploaded
    for i in range(3):
        batch = bg.GpuCommandBatch(gpu)
        y = small_layer(batch, batch.upload(x + i), tw, tb)
        batch.execute()
        np.testing.assert_allclose(batch.read(y), np.maximum((x + i) @ w + b, 0), rtol=1e-5, atol=1e-5)
    assert gpu.stats.bytes_uploaded - uploaded == 3 * x.nbytes  # only the inputs, never the weights again


def test_reading_an_intermediate_joins_later_submits(gpu, layer_data):
    x, w, _b = layer_data
    batch = bg.GpuCommandBatch(gpu)
    tx = batch.upload(x)
    h = batch.matmul(tx, gpu.tensor(w))
    y = batch.relu(h)
    batch.execute()
    submits = gpu.stats.submits
    np.testing.assert_allclose(batch.read(y), np.maximum(x @ w, 0), rtol=1e-5, atol=1e-6)
    assert gpu.stats.submits == submits  # the final output rode in the execute's submit
    np.testing.assert_allclose(batch.read(h), x @ w, rtol=1e-5, atol=1e-6)
    assert gpu.stats.submits == submits + 1  # not an output: one extra copy submit the first time
    batch.execute()
    submits = gpu.stats.submits
    np.testing.assert_allclose(batch.read(h), x @ w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(batch.read(y), np.maximum(x @ w, 0), rtol=1e-5, atol=1e-6)
    assert gpu.stats.submits == submits  # both now ride in the execute's submit


def test_only_what_is_read_is_copied_back(gpu):
    """Once the user reads some tensors, executes copy back only those (a decode step reads one id)."""
    x = random_array(np.random.default_rng(28), (1000,), np.float32)
    batch = bg.GpuCommandBatch(gpu)
    tx = batch.upload(x)
    big = batch.mul(tx, 2.0)  # an unconsumed output: copied back before any read
    small = batch.argmax(tx)
    batch.execute()
    before = gpu.stats.bytes_read
    assert batch.read(small) == np.argmax(x)
    assert gpu.stats.bytes_read - before == big.nbytes + 4  # the first execute copied both outputs
    batch.execute()
    before = gpu.stats.bytes_read
    assert batch.read(small) == np.argmax(x)
    assert gpu.stats.bytes_read - before == 4  # now only the token-sized result


def test_inputs_are_readable_and_keep_their_last_value(gpu):
    x = random_array(np.random.default_rng(22), (9,), np.int32)
    batch = bg.GpuCommandBatch(gpu)
    tx = batch.upload(x)
    y = batch.mul(tx, 3)
    batch.execute()
    np.testing.assert_array_equal(batch.read(tx), x)
    batch.execute({tx: x + 1})
    batch.execute()  # no feed: the input keeps x + 1
    np.testing.assert_array_equal(batch.read(y), (x + 1) * 3)


def test_reference_executor_runs_the_same_batch(ref, gpu, layer_data):
    x, w, b = layer_data
    results = []
    for device in (ref, gpu):
        batch = bg.GpuCommandBatch(device)
        tx = batch.upload(x)
        y = small_layer(batch, tx, device.tensor(w), device.tensor(b))
        batch.execute()
        batch.execute({tx: x * 2})
        results.append(batch.read(y))
    np.testing.assert_allclose(results[1], results[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(results[0], np.maximum((x * 2) @ w + b, 0), rtol=1e-6, atol=1e-6)


def test_resident_tensor_read_and_write(gpu):
    data = random_array(np.random.default_rng(23), (4, 5), np.float32)
    t = gpu.tensor(data)
    np.testing.assert_array_equal(gpu.read(t), data)
    gpu.write(t, data * 2)
    np.testing.assert_array_equal(gpu.read(t), data * 2)


def test_float16_inputs_of_odd_length(gpu):
    x = random_array(np.random.default_rng(24), (7,), np.float16)
    batch = bg.GpuCommandBatch(gpu)
    y = batch.add(batch.upload(x), batch.upload(x))
    batch.execute()
    np.testing.assert_array_equal(batch.read(y), x + x)


def test_staging_and_memory_stay_flat_over_10000_executes(gpu):
    rng = np.random.default_rng(25)
    x = random_array(rng, (64,), np.float32)
    batch = bg.GpuCommandBatch(gpu)
    tx = batch.upload(x)
    y = batch.add(batch.mul(tx, 2.0), 1.0)
    process = psutil.Process()
    for _ in range(200):  # warm up allocators and caches
        batch.execute()
        batch.read(y)
    gc.collect()
    rss_before = process.memory_info().rss
    buffers_before = gpu.stats.buffers_created
    live_before = gpu.stats.buffers_live
    for _i in range(10_000):
        batch.execute()
        out = batch.read(y)
    gc.collect()
    np.testing.assert_allclose(out, x * 2 + 1, rtol=1e-6)
    assert gpu.stats.buffers_created == buffers_before  # staging buffers are reused, not created
    assert gpu.stats.buffers_live == live_before
    assert gpu.stats.staging_idle <= 16
    growth = process.memory_info().rss - rss_before
    assert growth < 16 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB over 10,000 executes"


def test_unread_executes_do_not_leak_staging(gpu):
    batch = bg.GpuCommandBatch(gpu)
    y = batch.neg(batch.upload(np.arange(1, 10, dtype=np.float32)))
    batch.execute()
    created = gpu.stats.buffers_created
    for _ in range(500):
        batch.execute()  # never read: each superseded execute gives its staging buffer back
    np.testing.assert_array_equal(batch.read(y), -np.arange(1, 10, dtype=np.float32))
    assert gpu.stats.buffers_created - created <= 1


@pytest.mark.asyncio
async def test_async_read_yields_to_the_event_loop(gpu):
    rng = np.random.default_rng(26)
    a = random_array(rng, (256, 256), np.float32)
    w = (a / 32).astype(np.float32)  # contractive: errors shrink through the chain
    batch = bg.GpuCommandBatch(gpu)
    t = batch.upload(a)
    tw = batch.upload(w)
    for _ in range(20):
        t = batch.tanh(batch.matmul(t, tw))
    async with counting_event_loop_ticks() as other_task:
        await batch.execute_async()
        out = await batch.read_async(t)
    assert other_task.ticks > 1, "the event loop did not run while the GPU worked"
    expected = a
    for _ in range(20):
        expected = np.tanh(expected @ w)
    np.testing.assert_allclose(out, expected, rtol=1e-3, atol=1e-4)


@pytest.mark.asyncio
async def test_concurrent_reads_of_one_execute(gpu):
    x = random_array(np.random.default_rng(27), (100,), np.float32)
    batch = bg.GpuCommandBatch(gpu)
    tx = batch.upload(x)
    outs = [batch.mul(tx, float(i + 1)) for i in range(4)]
    await batch.execute_async()
    submits = gpu.stats.submits
    results = await asyncio.gather(*(batch.read_async(o) for o in outs))
    assert gpu.stats.submits == submits
    for i, r in enumerate(results):
        np.testing.assert_allclose(r, x * (i + 1), rtol=1e-6)


def test_read_names_and_the_deprecated_alias(ref):
    """``read`` returns an array on a batch, a Submission and a Device alike; ``read_async`` is the
    coroutine; ``read_sync`` still works for one release, with a DeprecationWarning naming the new pair."""
    import asyncio

    batch = bg.GpuCommandBatch(ref)
    y = batch.upload(np.arange(3, dtype=np.float32)) * 2
    submission = batch.execute()
    expected = np.arange(3, dtype=np.float32) * 2
    for value in (
        batch.read(y),
        submission.read(y),
        asyncio.run(batch.read_async(y)),
        asyncio.run(submission.read_async(y)),
    ):
        np.testing.assert_array_equal(np.asarray(value), expected)
    for reader in (batch, submission):
        with pytest.warns(DeprecationWarning, match=r"read_sync is deprecated: use read\(\)"):
            np.testing.assert_array_equal(reader.read_sync(y), expected)
    w = ref.tensor(expected)
    np.testing.assert_array_equal(asyncio.run(ref.read_async(w)), ref.read(w))


def test_feeds_by_input_name(ref):
    batch = bg.GpuCommandBatch(ref)
    x = batch.upload(np.zeros(3, np.float32), name="x")
    scale = batch.upload(np.ones(1, np.float32), name="scale")
    y = x * scale
    batch.execute({"x": np.arange(3, dtype=np.float32), scale: np.full(1, 2.0, np.float32)})
    np.testing.assert_array_equal(batch.read(y), [0.0, 2.0, 4.0])
    twin = batch.upload(np.zeros(3, np.float32), name="x")
    with pytest.raises(
        bg.ArgumentError, match=r"feed 'x' names 2 inputs of batch .* \(its inputs: 'x', 'scale', 'x'\)"
    ):
        batch.execute({"x": np.ones(3, np.float32)})
    twin.name = "x2"  # renamed: the name is found again
    with pytest.raises(bg.ArgumentError, match=r"feed 'y' names no input"):
        batch.execute({"y": np.ones(3, np.float32)})
    batch.execute([("x", np.ones(3, np.float32))])
    np.testing.assert_array_equal(batch.read(y), [2.0, 2.0, 2.0])
