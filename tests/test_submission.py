"""``execute()`` returns a Submission: its outputs stay readable after later executes (submit ahead, read
behind), on every executor; what it did not copy back is refused by name."""

from __future__ import annotations

import asyncio
import gc

import numpy as np
import pytest

import batchgpu as bg
from batchgpu.errors import BatchError


@pytest.fixture(params=["gpu", "ref"])
def device(request) -> bg.Device:
    return request.getfixturevalue(request.param)


def test_each_submission_reads_its_own_execute(device):
    batch = bg.GpuCommandBatch(device)
    x = batch.upload(np.zeros((3, 7), np.float32))
    y = batch.relu(batch.add(x, 0.5))
    batch.outputs(y)
    rng = np.random.default_rng(0)
    feeds = [rng.standard_normal((3, 7), dtype=np.float32) for _ in range(6)]
    submissions = [batch.execute({x: f}) for f in feeds]
    gc.collect()
    for submission, f in reversed(list(zip(submissions, feeds))):  # newest first: the old ones were kept
        np.testing.assert_array_equal(submission.read(y), np.maximum(f + np.float32(0.5), 0))
    np.testing.assert_array_equal(batch.read(y), np.maximum(feeds[-1] + np.float32(0.5), 0))
    first = asyncio.run(submissions[0].read_async(y))
    np.testing.assert_array_equal(first, np.maximum(feeds[0] + np.float32(0.5), 0))


def test_a_submission_survives_a_new_plan_and_many_executes(device):
    batch = bg.GpuCommandBatch(device)
    x = batch.upload(np.arange(5, dtype=np.float32))
    y = batch.mul(x, 2.0)
    batch.outputs(y)
    kept = batch.execute()
    z = batch.add(y, 1.0)  # the recording changes: the next execute plans anew
    batch.outputs(y, z)
    for i in range(20):  # staging buffers are recycled by executes that nothing holds
        batch.execute({x: np.full(5, i, np.float32)})
    np.testing.assert_array_equal(kept.read(y), np.arange(5, dtype=np.float32) * 2)


def test_what_a_submission_did_not_copy_back_is_refused(device):
    batch = bg.GpuCommandBatch(device)
    x = batch.upload(np.ones(4, np.float32))
    hidden = batch.exp(x)
    y = batch.neg(batch.sqrt(hidden))
    batch.outputs(y)
    submission = batch.execute()
    with pytest.raises(BatchError, match=r"read: .*exp\d+.* was not copied back by this execute"):
        submission.read(hidden)
    submission.release()
    with pytest.raises(BatchError, match="was not copied back"):
        submission.read(y)
    np.testing.assert_allclose(batch.read(y), -np.sqrt(np.exp(np.ones(4, np.float32))), rtol=1e-6)
