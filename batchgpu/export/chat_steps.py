"""The steps an exported chat app runs, recorded and run in Python too: one sequence's decoder over a KV cache on
the device, with sampling on the device.

- ``prefill_<n>`` for n = 1, 2, 4, ..., ``chunk``: n prompt tokens (input ``ids``) at position scalar ``pos``;
  a prompt runs as chunks of ``chunk`` tokens, then the binary digits of the rest (37 = 32 + 4 + 1), so no
  step computes padding;
- ``decode``: one token, read from the device where the step before left it, at ``pos``.

Every step samples the next token from its last row's logits (``GpuCommandBatch.sample``: inputs ``sampling``
(1, 4) = temperature, top_p, min_p, 0; ``top_k`` (1,); ``keys`` (1, 2) = seed, the token's index), outputs it
as ``next_id`` and leaves it on the device for the next decode step. The page (``batchgpu.js``) drives these
exact batches, so :meth:`ChatSteps.generate` gives the ids the page gives for the same settings (up to the
browser's float latitude, which can flip a near-tie). The page also keeps the cache's rows of a prompt's
common prefix with the ids it holds from the run before and runs the prefill steps from that ``pos`` on:
each step writes rows ``pos + t`` and attends over rows up to its own (windowed layers over fewer), so rows
past the prefix are written before any step reads them, and the ids are those of a run from position 0.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..batch import GpuCommandBatch, Submission
from ..device import Device
from ..errors import ArgumentError, BatchError
from ..models.decoder import ContiguousKV, record_decoder, record_logits
from ..models.llama import LlamaConfig
from ..models.row_pieces import Weight
from ..tensor import Tensor

SAMPLING_INPUTS = ("sampling", "top_k", "keys")


@dataclass(frozen=True)
class Sampling:
    """How each token is drawn: greedy at temperature 0; else from softmax(logits / temperature) restricted to
    ``top_k`` (0: off), ``top_p`` and ``min_p``, by a counter-based hash of (``seed``, token index)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        checks = (
            ("temperature", self.temperature >= 0),
            ("top_p", 0 < self.top_p <= 1),
            ("min_p", 0 <= self.min_p <= 1),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0),
            ("seed", isinstance(self.seed, int) and 0 <= self.seed < 2**32),
        )
        for name, ok in checks:
            if not ok:
                raise ArgumentError(f"Sampling: {name} out of range, got {getattr(self, name)!r}")

    def feeds(self, index: int) -> dict[str, np.ndarray]:
        """The sampling inputs of the ``index``-th generated token."""
        return {
            "sampling": np.array([[self.temperature, self.top_p, self.min_p, 0.0]], np.float32),
            "top_k": np.array([self.top_k], np.int32),
            "keys": np.array([[self.seed, index]], np.uint32),
        }


@dataclass
class Step:
    """One recorded step: its batch, its inputs by name and its sampled ``next_id``."""

    batch: GpuCommandBatch
    tokens: int
    inputs: dict[str, Tensor]
    next_id: Tensor


def chunks(length: int, chunk: int) -> list[int]:
    """The prefill steps a prompt of ``length`` tokens runs: ``chunk``-token steps, then the powers of two of
    the rest, largest first."""
    whole, rest = divmod(length, chunk)
    return [chunk] * whole + [1 << bit for bit in reversed(range(rest.bit_length())) if rest >> bit & 1]


class ChatSteps:
    """The recorded steps of one sequence over ``config``'s decoder with ``weights`` resident on ``device``,
    a KV cache of ``max_context`` positions (``kv_dtype``: float32, or float16 as the f16 variant of an export
    keeps it) and prefill chunks of up to ``chunk`` tokens (a power of two)."""

    def __init__(
        self,
        device: Device,
        config: LlamaConfig,
        weights: dict[str, Weight],
        *,
        max_context: int,
        chunk: int,
        kv_dtype: Any = np.float32,
    ) -> None:
        if chunk < 1 or chunk & (chunk - 1):
            raise ArgumentError(f"ChatSteps: chunk must be a power of two >= 1, got {chunk!r}")
        if not 1 <= max_context <= (config.context or max_context):
            raise ArgumentError(f"ChatSteps: max_context must be in [1, {config.context}], got {max_context!r}")
        self.device, self.config, self.weights = device, config, weights
        self.max_context, self.chunk = max_context, chunk
        self.kv_dtype = np.dtype(kv_dtype)
        if self.kv_dtype not in (np.dtype(np.float32), np.dtype(np.float16)):
            raise ArgumentError(f"ChatSteps: kv_dtype must be float32 or float16, got {kv_dtype!r}")
        zeros = np.zeros((max_context, config.kv_heads, config.head_dim), self.kv_dtype)
        self.caches = [
            (device.tensor(zeros, name=f"k{i}"), device.tensor(zeros, name=f"v{i}")) for i in range(config.layers)
        ]
        self.token = device.tensor(np.zeros((1, 1), np.int32), name="token")
        self.steps: dict[str, Step] = {"decode": self._record("decode", 1)}
        for size in (1 << bit for bit in range(chunk.bit_length())):
            self.steps[f"prefill_{size}"] = self._record(f"prefill_{size}", size)

    def _record(self, name: str, tokens: int) -> Step:
        batch = GpuCommandBatch(self.device, name=name)
        pos = batch.scalar("pos")
        inputs: dict[str, Tensor] = {}
        if name == "decode":
            ids = batch.reshape(self.token, (1,))
        else:
            ids = inputs["ids"] = batch.upload(np.zeros(tokens, np.int32), name="ids")
        normed = record_decoder(batch, self.config, self.weights, ids, ContiguousKV(self.caches, pos))
        last = batch.slice(normed, (slice(tokens - 1, tokens),)) if tokens > 1 else normed
        logits = record_logits(batch, self.weights, last)
        inputs["sampling"] = batch.upload(np.zeros((1, 4), np.float32), name="sampling")
        inputs["top_k"] = batch.upload(np.zeros(1, np.int32), name="top_k")
        inputs["keys"] = batch.upload(np.zeros((1, 2), np.uint32), name="keys")
        next_id = batch.sample(logits, inputs["sampling"], inputs["top_k"], inputs["keys"], name="next_id")
        row = batch.upload(np.zeros(1, np.int32), name="token_row")
        batch.scatter_rows(self.token, row, batch.reshape(next_id, (1, 1)))  # the next decode step's input
        batch.outputs(next_id)
        return Step(batch, tokens, inputs, next_id)

    def _run(self, step: Step, pos: int, feeds: dict[str, Any]) -> Submission:
        named = {step.inputs[name]: value for name, value in feeds.items()}
        return step.batch.execute(named, scalars={"pos": pos})

    def generate(
        self, prompt: Sequence[int], max_tokens: int, sampling: Sampling | None = None, stop: Sequence[int] = ()
    ) -> Iterator[int]:
        """The ids the page generates for ``prompt`` (ids): up to ``max_tokens``, ending after a ``stop`` id or
        at ``max_context`` positions."""
        sampling = sampling or Sampling()
        prompt = [int(t) for t in prompt]
        if not prompt or len(prompt) >= self.max_context:
            raise BatchError(f"ChatSteps: the prompt needs 1 to {self.max_context - 1} tokens, got {len(prompt)}")
        pos = 0
        submission = None
        for size in chunks(len(prompt), self.chunk):
            if submission is not None:
                submission.release()  # only the last chunk's token is read
            feeds = {"ids": np.asarray(prompt[pos : pos + size], np.int32), **sampling.feeds(0)}
            submission = self._run(self.steps[f"prefill_{size}"], pos, feeds)
            pos += size
        assert submission is not None
        step = self.steps[f"prefill_{size}"]
        for index in range(max_tokens):
            token = int(submission.read(step.next_id)[0])
            submission.release()
            yield token
            if token in stop or pos >= self.max_context or index + 1 == max_tokens:
                return
            step = self.steps["decode"]
            submission = self._run(step, pos, sampling.feeds(index + 1))
            pos += 1
