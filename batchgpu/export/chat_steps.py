"""The steps an exported chat app runs, recorded and run in Python too: one sequence's decoder over a KV cache on
the device, with sampling on the device.

- ``prefill_<n>`` for n = 1, 2, 4, ..., ``chunk``: n prompt tokens (input ``ids``) at position scalar ``pos``;
  a prompt runs as chunks of ``chunk`` tokens, then the binary digits of the rest (37 = 32 + 4 + 1), so no
  step computes padding;
- ``decode``: one token, read from the device where the step before left it, at ``pos``;
- ``verify_<n>`` for n = 2 ... ``speculative_tokens`` + 1: speculative decoding's verify steps (prompt lookup, as
  :meth:`~batchgpu.models.llama.Llama.speculate` runs it): the latest token and n - 1 drafted ones (input
  ``ids``) at ``pos``, whose output ``next_ids`` is every row's greedy id (``argmax``, the rule greedy sampling
  follows), the ids :func:`~batchgpu.models.speculative.accepted` keeps a prefix of.

The decode and prefill steps sample the next token from their last row's logits (``GpuCommandBatch.sample``:
inputs ``sampling`` (1, 4) = temperature, top_p, min_p, 0; ``top_k`` (1,); ``keys`` (1, 2) = seed, the token's
index), output it as ``next_id`` and leave it on the device for the next decode step (a verify step leaves
nothing there: the page runs a speculative reply on steps with ``ids`` inputs only). The page (``batchgpu.js``)
drives these exact batches, so :meth:`ChatSteps.generate` gives the ids the page gives for the same settings (up
to the browser's float latitude, which can flip a near-tie). The page also keeps the cache's rows of a prompt's
common prefix with the ids it holds from the run before and runs the prefill steps from that ``pos`` on:
each step writes rows ``pos + t`` and attends over rows up to its own (windowed layers over fewer), so rows
past the prefix are written before any step reads them, and the ids are those of a run from position 0. A
speculative step's rows past the ids it keeps are written again by the next step the same way.
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
from ..models.speculative import Speculative, accepted, prompt_lookup
from ..tensor import Tensor

SAMPLING_INPUTS = ("sampling", "top_k", "keys")
SPECULATIVE_TOKENS = 4
"""Drafted tokens per verify step an export holds steps for by default (``export-chat --speculative-tokens``)."""
MAX_SPECULATIVE_TOKENS = 64
"""The most drafted tokens per verify step an export records steps for (one step per row count)."""


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
    """One recorded step: its batch, its inputs by name and its output ``next_id`` (the sampled id; for a verify
    step ``next_ids``, every row's greedy id: :attr:`output` names it)."""

    batch: GpuCommandBatch
    tokens: int
    inputs: dict[str, Tensor]
    next_id: Tensor
    output: str = "next_id"


def chunks(length: int, chunk: int) -> list[int]:
    """The prefill steps a prompt of ``length`` tokens runs: ``chunk``-token steps, then the powers of two of
    the rest, largest first."""
    whole, rest = divmod(length, chunk)
    return [chunk] * whole + [1 << bit for bit in reversed(range(rest.bit_length())) if rest >> bit & 1]


def check_speculative_tokens(value: Any, max_context: int, what: str) -> None:
    """ArgumentError naming ``what`` unless ``value`` is an int from 0 to :data:`MAX_SPECULATIVE_TOKENS` whose
    verify step (the latest token and ``value`` drafted ones) fits in ``max_context`` positions."""
    most = min(MAX_SPECULATIVE_TOKENS, max_context - 1)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
        raise ArgumentError(
            f"{what}: speculative_tokens must be an int in [0, {most}] (a verify step's rows, the latest token and "
            f"the drafted ones, fit in max_context={max_context}), got {value!r}"
        )


class ChatSteps:
    """The recorded steps of one sequence over ``config``'s decoder with ``weights`` resident on ``device``,
    a KV cache of ``max_context`` positions (``kv_dtype``: float32, or float16 as the f16 variant of an export
    keeps it), prefill chunks of up to ``chunk`` tokens (a power of two) and verify steps for up to
    ``speculative_tokens`` drafted tokens (0: none)."""

    def __init__(
        self,
        device: Device,
        config: LlamaConfig,
        weights: dict[str, Weight],
        *,
        max_context: int,
        chunk: int,
        kv_dtype: Any = np.float32,
        speculative_tokens: int = SPECULATIVE_TOKENS,
    ) -> None:
        if chunk < 1 or chunk & (chunk - 1):
            raise ArgumentError(f"ChatSteps: chunk must be a power of two >= 1, got {chunk!r}")
        if not 1 <= max_context <= (config.context or max_context):
            raise ArgumentError(f"ChatSteps: max_context must be in [1, {config.context}], got {max_context!r}")
        check_speculative_tokens(speculative_tokens, max_context, "ChatSteps")
        self.device, self.config, self.weights = device, config, weights
        self.max_context, self.chunk, self.speculative_tokens = max_context, chunk, speculative_tokens
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
        for rows in range(2, speculative_tokens + 2):
            self.steps[f"verify_{rows}"] = self._record(f"verify_{rows}", rows, every_row=True)
        self.speculation: dict[str, int] = {}
        """The last speculative :meth:`generate`'s verify steps and drafted and accepted tokens."""

    def _record(self, name: str, tokens: int, every_row: bool = False) -> Step:
        batch = GpuCommandBatch(self.device, name=name)
        pos = batch.scalar("pos")
        inputs: dict[str, Tensor] = {}
        if name == "decode":
            ids = batch.reshape(self.token, (1,))
        else:
            ids = inputs["ids"] = batch.upload(np.zeros(tokens, np.int32), name="ids")
        normed = record_decoder(batch, self.config, self.weights, ids, ContiguousKV(self.caches, pos))
        if every_row:  # as Llama.record(every_row=True): the greedy id after each row
            next_ids = batch.argmax(record_logits(batch, self.weights, normed), name="next_ids")
            batch.outputs(next_ids)
            return Step(batch, tokens, inputs, next_ids, "next_ids")
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
        self,
        prompt: Sequence[int],
        max_tokens: int,
        sampling: Sampling | None = None,
        stop: Sequence[int] = (),
        speculative: Speculative | None = None,
    ) -> Iterator[int]:
        """The ids the page generates for ``prompt`` (ids): up to ``max_tokens``, ending after a ``stop`` id or
        at ``max_context`` positions. ``speculative`` (prompt lookup, greedy only: ``Speculative("ngram", K)``
        with K <= ``speculative_tokens``): the page's speculative decoding (:meth:`_speculate`), the same ids."""
        sampling = sampling or Sampling()
        prompt = [int(t) for t in prompt]
        if not prompt or len(prompt) >= self.max_context:
            raise BatchError(f"ChatSteps: the prompt needs 1 to {self.max_context - 1} tokens, got {len(prompt)}")
        if speculative is not None:
            self._check_speculative(speculative, sampling)
            yield from self._speculate(prompt, max_tokens, sampling, stop, speculative)
            return
        pos, submission = self._prefill(prompt, sampling)
        step = self.steps[f"prefill_{chunks(len(prompt), self.chunk)[-1]}"]
        for index in range(max_tokens):
            token = int(submission.read(step.next_id)[0])
            submission.release()
            yield token
            if token in stop or pos >= self.max_context or index + 1 == max_tokens:
                return
            step = self.steps["decode"]
            submission = self._run(step, pos, sampling.feeds(index + 1))
            pos += 1

    def _prefill(self, prompt: list[int], sampling: Sampling) -> tuple[int, Submission]:
        """Run the prompt's prefill steps from position 0: the position after it and the last step's run."""
        pos = 0
        submission = None
        for size in chunks(len(prompt), self.chunk):
            if submission is not None:
                submission.release()  # only the last chunk's token is read
            feeds = {"ids": np.asarray(prompt[pos : pos + size], np.int32), **sampling.feeds(0)}
            submission = self._run(self.steps[f"prefill_{size}"], pos, feeds)
            pos += size
        assert submission is not None
        return pos, submission

    def _check_speculative(self, speculative: Speculative, sampling: Sampling) -> None:
        if not isinstance(speculative, Speculative) or speculative.method != "ngram":
            raise ArgumentError(f"ChatSteps.generate: speculative must be Speculative('ngram', K), got {speculative!r}")
        if speculative.tokens > self.speculative_tokens:
            raise ArgumentError(
                f"ChatSteps.generate: speculative tokens must be at most {self.speculative_tokens} (the verify "
                f"steps recorded), got {speculative.tokens}"
            )
        if sampling.temperature > 0:
            raise ArgumentError(
                f"ChatSteps.generate: speculative decoding is greedy only (temperature 0), got temperature "
                f"{sampling.temperature}"
            )

    def _speculate(
        self, prompt: list[int], max_tokens: int, sampling: Sampling, stop: Sequence[int], speculative: Speculative
    ) -> Iterator[int]:
        """Greedy speculative decoding as the page runs it: after the prompt, each step runs the latest token
        and up to ``speculative.tokens`` tokens drafted by prompt lookup (``verify_<n>``; ``prefill_1`` on the
        latest token where nothing is drafted) and keeps the drafted tokens its greedy ids confirm, and one
        more; the rows after them are written again by the next step. :attr:`speculation` counts the steps
        after the prompt (``verify_steps``, as :meth:`Llama.speculate` counts them: a reply of n tokens not cut
        short takes 1 + ``verify_steps`` + ``accepted`` = n) and the drafted and accepted tokens."""
        self.speculation = counts = {"verify_steps": 0, "drafted": 0, "accepted": 0}
        pos, submission = self._prefill(prompt, sampling)
        step = self.steps[f"prefill_{chunks(len(prompt), self.chunk)[-1]}"]
        out = [int(submission.read(step.next_id)[0])]
        submission.release()
        history, generated = list(prompt), 0
        while True:
            history += out  # the ids of positions 0, 1, ...; the rows of those before ``pos`` are written
            for token in out:
                generated += 1
                yield token
                if token in stop or generated == max_tokens:
                    return
            if pos >= self.max_context:
                return
            room = min(max_tokens - generated, self.max_context - pos) - 1
            limit = min(speculative.tokens, room)
            draft = prompt_lookup(history, limit, speculative.min_ngram, speculative.max_ngram) if limit > 0 else []
            rows = np.asarray([history[-1], *draft], np.int32)
            if draft:
                step = self.steps[f"verify_{rows.size}"]
                submission = self._run(step, pos, {"ids": rows})
            else:
                step = self.steps["prefill_1"]
                submission = self._run(step, pos, {"ids": rows, **sampling.feeds(generated)})
            counts["verify_steps"] += 1
            counts["drafted"] += len(draft)
            sampled = submission.read(step.next_id).tolist()
            submission.release()
            out = accepted(draft, sampled)
            pos += len(out)  # the latest token's row and the accepted drafted tokens'
            counts["accepted"] += len(out) - 1
