"""asyncio on one batch: every read is bound when it is requested (called), to the execute it follows,
and holds that execute's read-back results until it completes; later executes, ``release()`` and
cancelled awaits never break it. Executor-neutral (collected again for CUDA/HIP).

The contract is ordering, not timing: a read requested after execute n and before execute n + 1 returns
n's values whether the device finished n before or after n + 1 was submitted (a real GPU completes work
and map callbacks later than lavapipe, whose submit blocks while earlier work runs). The values are
exact: one correctly rounded f32 add, and a maximum scaled by 4 (both exact in WGSL, CUDA and numpy)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
from collections.abc import Iterator

import numpy as np
import pytest

import batchgpu as bg
from batchgpu.errors import BatchError

from .conftest import random_array

SHAPE = (5, 13)
TASKS, ROUNDS = 16, 10


@pytest.fixture(params=["gpu", "ref"])
def dev(request) -> bg.Device:
    return request.getfixturevalue(request.param)


class Graph:
    """One batch ``y = x + w``, ``z = maximum(x, w) * 4`` (both declared outputs) and its numpy twin."""

    def __init__(self, dev: bg.Device, *, declare: bool = True) -> None:
        self.batch = bg.GpuCommandBatch(dev)
        self.x = self.batch.upload(np.zeros(SHAPE, np.float32), name="x")
        self.w = self.batch.upload(np.zeros(SHAPE, np.float32), name="w")
        self.y = self.batch.add(self.x, self.w)
        self.hidden = self.batch.maximum(self.x, self.w)
        self.z = self.batch.mul(self.hidden, 4.0)
        if declare:
            self.batch.outputs(self.y, self.z)

    def feeds(self, rng: np.random.Generator) -> dict[bg.Tensor, np.ndarray]:
        return {self.x: random_array(rng, SHAPE, np.float32), self.w: random_array(rng, SHAPE, np.float32)}

    def expected(self, feeds: dict[bg.Tensor, np.ndarray]) -> dict[bg.Tensor, np.ndarray]:
        xa, wa = feeds[self.x], feeds[self.w]
        return {self.y: xa + wa, self.hidden: np.maximum(xa, wa), self.z: np.maximum(xa, wa) * np.float32(4)}

    def check(self, values: dict[bg.Tensor, np.ndarray], feeds: dict[bg.Tensor, np.ndarray]) -> None:
        expected = self.expected(feeds)
        for tensor, value in values.items():
            np.testing.assert_array_equal(value, expected[tensor], err_msg=tensor.name)


def reader_of(batch: bg.GpuCommandBatch, submission: bg.Submission, form: str):
    """The Submission, or the batch (the Submission then goes: nothing but the batch and the reads hold it)."""
    return submission if form == "submission" else batch


@contextlib.contextmanager
def device_busy(dev: bg.Device) -> Iterator[None]:
    """Until the block ends, the executor's wait worker (where it has one) is held, so the device waits of
    reads begun inside stay in flight: a GPU still busy with the execute when the host goes on."""
    waits = getattr(dev.executor, "waits", None)
    finished = threading.Event()
    if waits is not None:
        waits.submit(finished.wait, 60)
    try:
        yield
    finally:
        finished.set()


async def started(coroutine) -> asyncio.Task:
    """``coroutine`` as a task that has begun (its wait for the device is in flight where there is one)."""
    task = asyncio.ensure_future(coroutine)
    await asyncio.sleep(0)
    return task


@pytest.mark.asyncio
@pytest.mark.parametrize("form", ["submission", "batch"])
async def test_16_tasks_on_one_batch_each_read_their_own_execute(dev, form):
    graph = Graph(dev)
    done = [0] * TASKS

    async def task(index: int) -> None:
        rng = np.random.default_rng(index)
        for _ in range(ROUNDS):
            feeds = graph.feeds(rng)
            reader = await graph.batch.execute_async(feeds)  # its Submission
            if form == "batch":
                reader = graph.batch  # the Submission goes: only the batch's hold and the reads' keep the execute
            pending = [reader.read_async(graph.y), reader.read_async(graph.z)]  # bound now, awaited below
            if rng.random() < 0.5:
                await asyncio.sleep(0)  # other tasks execute before these reads are awaited
            y, z = [await read for read in pending]
            graph.check({graph.y: y, graph.z: z}, feeds)
            done[index] += 1

    await asyncio.gather(*(task(i) for i in range(TASKS)))
    assert done == [ROUNDS] * TASKS


@pytest.mark.asyncio
@pytest.mark.parametrize("later", ["execute", "execute_async"])
@pytest.mark.parametrize("begun", [True, False], ids=["awaiting", "not-awaited-yet"])
@pytest.mark.parametrize("form", ["submission", "batch"])
async def test_a_pending_read_returns_the_execute_it_follows(dev, form, begun, later):
    graph = Graph(dev)
    rng = np.random.default_rng(2)
    first, second = graph.feeds(rng), graph.feeds(rng)
    reader = reader_of(graph.batch, graph.batch.execute(first), form)
    with device_busy(dev):
        reads = [reader.read_async(graph.y), reader.read_async(graph.z)]
        if begun:
            reads = [await started(read) for read in reads]
        if later == "execute":
            graph.batch.execute(second)
        else:
            await graph.batch.execute_async(second)
    graph.check({graph.y: await reads[0], graph.z: await reads[1]}, first)
    graph.check({graph.y: graph.batch.read(graph.y), graph.z: await graph.batch.read_async(graph.z)}, second)


@pytest.mark.asyncio
async def test_execute_async_submits_when_called(dev):
    """Calls are the queue's order: a read requested after an ``execute_async`` call reads that execute,
    even when awaited before it."""
    graph = Graph(dev)
    rng = np.random.default_rng(10)
    first, second = graph.feeds(rng), graph.feeds(rng)
    graph.batch.execute(first)
    submitting = graph.batch.execute_async(second)
    read = graph.batch.read_async(graph.y)
    graph.check({graph.y: await read}, second)
    submission = await submitting
    graph.check({graph.z: await submission.read_async(graph.z)}, second)


@pytest.mark.asyncio
async def test_a_pending_first_read_of_an_undeclared_tensor_returns_the_execute_it_follows(dev):
    """A tensor the execute did not copy back is copied when the read is requested, not when awaited."""
    graph = Graph(dev, declare=False)
    rng = np.random.default_rng(3)
    first, second, third = graph.feeds(rng), graph.feeds(rng), graph.feeds(rng)
    graph.batch.execute(first)
    with device_busy(dev):
        waiting = await started(graph.batch.read_async(graph.hidden))
        unawaited = graph.batch.read_async(graph.hidden)
        graph.batch.execute(second)
        newer = graph.batch.read_async(graph.hidden)  # copied back by the next execute: it was read before
        graph.batch.execute(third)
    graph.check({graph.hidden: await waiting}, first)
    graph.check({graph.hidden: await unawaited}, first)
    graph.check({graph.hidden: await newer}, second)
    graph.check({graph.hidden: graph.batch.read(graph.hidden)}, third)


@pytest.mark.asyncio
async def test_interleaved_executes_and_reads_return_the_latest_execute_before_each_read(dev):
    graph = Graph(dev)
    rng = np.random.default_rng(4)
    submissions, reads = [], []
    with device_busy(dev):
        for round_ in range(12):
            feeds = graph.feeds(rng)
            submissions.append((await graph.batch.execute_async(feeds), feeds))
            if round_ % 3 == 0:
                reads.append((graph.y, await started(graph.batch.read_async(graph.y)), feeds))
            elif round_ % 3 == 1:
                reads.append((graph.z, graph.batch.read_async(graph.z), feeds))
    for tensor, read, feeds in reads:
        graph.check({tensor: await read}, feeds)
    for submission, feeds in reversed(submissions):  # every execute is still readable through its Submission
        graph.check({graph.y: await submission.read_async(graph.y), graph.z: submission.read(graph.z)}, feeds)
    graph.check({graph.y: graph.batch.read(graph.y)}, submissions[-1][1])


@pytest.mark.asyncio
async def test_an_old_submission_reads_its_execute_after_executes_and_a_new_plan(dev):
    graph = Graph(dev)
    rng = np.random.default_rng(5)
    kept_feeds = graph.feeds(rng)
    kept = graph.batch.execute(kept_feeds)
    with device_busy(dev):
        pending = await started(kept.read_async(graph.z))
        graph.batch.relu(graph.y)  # the recording changes: the next execute plans anew
        for _ in range(7):
            graph.batch.execute(graph.feeds(rng))
    graph.check({graph.z: await pending, graph.y: await kept.read_async(graph.y)}, kept_feeds)


@pytest.mark.asyncio
@pytest.mark.parametrize("form", ["submission", "batch"])
async def test_release_with_reads_pending(dev, form):
    """Reads requested before ``release()`` complete with their execute's values; later ones raise
    BatchError; the device goes on working."""
    graph = Graph(dev)
    rng = np.random.default_rng(6)
    feeds = graph.feeds(rng)
    reader = reader_of(graph.batch, graph.batch.execute(feeds), form)
    with device_busy(dev):
        waiting = await started(reader.read_async(graph.y))
        unawaited = reader.read_async(graph.z)
        graph.batch.release()
    graph.check({graph.y: await waiting, graph.z: await unawaited}, feeds)
    with pytest.raises(BatchError, match=r"read: batch .* was released"):
        await reader.read_async(graph.y)
    with pytest.raises(BatchError, match=r"read: batch .* was released"):
        reader.read(graph.y)
    again = Graph(dev)
    feeds = again.feeds(rng)
    await again.batch.execute_async(feeds)
    again.check({again.y: await again.batch.read_async(again.y)}, feeds)


@pytest.mark.asyncio
async def test_a_submission_released_while_its_read_is_pending(dev):
    graph = Graph(dev)
    rng = np.random.default_rng(7)
    feeds = graph.feeds(rng)
    submission = graph.batch.execute(feeds)
    with device_busy(dev):
        waiting = await started(submission.read_async(graph.y))
        unawaited = submission.read_async(graph.z)
        submission.release()
        graph.batch.execute(graph.feeds(rng))  # nothing else holds the first execute now
    graph.check({graph.y: await waiting, graph.z: await unawaited}, feeds)
    with pytest.raises(BatchError, match="was not copied back by this execute"):
        submission.read(graph.y)


@pytest.mark.asyncio
@pytest.mark.parametrize("cancel", ["task.cancel", "wait_for"])
async def test_cancelled_reads_leave_the_batch_usable(dev, cancel):
    """Awaits cancelled at every stage (before the read began, while the device is waited for), with and
    without a later execute superseding the execute; every read afterwards has its execute's values."""
    graph = Graph(dev)
    rng = np.random.default_rng(8)
    for round_ in range(12):
        feeds = graph.feeds(rng)
        submission = await graph.batch.execute_async(feeds)
        read = graph.batch.read_async(graph.y) if round_ % 2 else submission.read_async(graph.z)
        with device_busy(dev):  # the device has not finished when the await is cancelled
            if cancel == "wait_for":
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(read, timeout=0 if round_ % 4 < 2 else 1e-3)
            else:
                task = await started(read) if round_ % 3 else asyncio.ensure_future(read)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if round_ % 3 == 2:
                del submission
                graph.batch.execute(graph.feeds(rng))  # supersedes the execute while its cancelled wait is in flight
                continue
        graph.check({graph.y: await graph.batch.read_async(graph.y), graph.z: submission.read(graph.z)}, feeds)
    feeds = graph.feeds(rng)
    graph.batch.execute(feeds)
    graph.check({graph.y: graph.batch.read(graph.y), graph.z: await graph.batch.read_async(graph.z)}, feeds)


def test_submissions_collected_in_reference_cycles_give_back_intact_buffers(dev):
    """A Submission the cycle collector frees (its last reference in a reference cycle) lets its execute go
    with the staging buffers intact: later executes reuse them and read their own values."""
    graph = Graph(dev)
    rng = np.random.default_rng(9)
    for _ in range(6):
        cycle: list = [graph.batch.execute(graph.feeds(rng))]
        cycle.append(cycle)  # only the cycle holds the Submission now
        del cycle
        graph.batch.execute(graph.feeds(rng))  # the batch lets the first execute go: the cycle holds it alone
    gc.collect()
    for _ in range(12):
        feeds = graph.feeds(rng)
        graph.batch.execute(feeds)
        graph.check({graph.y: graph.batch.read(graph.y), graph.z: graph.batch.read(graph.z)}, feeds)
