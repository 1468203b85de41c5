"""What a generation request asks for: ``SamplingParams`` (OpenAI's and vLLM's names and defaults),
validated when the request is made, so a bad value fails that request alone."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..arguments import brief
from ..errors import RequestError
from ..ops.sampling import MAX_TOP
from .structured import StructuredOutput
from .tools import ToolCalling

INT32_MAX = 2**31 - 1
"""The largest ``top_k``: it goes to the device as an int32 (any value above the vocabulary keeps every
token, as 0 does)."""

FLOAT32_MAX = float(np.finfo(np.float32).max)
"""The largest temperature and repetition penalty: they go to the device as float32."""

MAX_LOGPROBS = MAX_TOP
"""The most top logprobs a token may ask for, 20 (OpenAI's ``top_logprobs`` limit; vLLM's default
``max_logprobs``): what the device's ``logprobs`` op gives per row."""

MAX_SAMPLES = 16
"""The most sequences one request may run (``n`` and ``best_of``): each takes a slot."""

GREEDY_BELOW = 1e-5
"""Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature`` 0 is greedy (the first most likely token), and so is any temperature below
    :data:`GREEDY_BELOW` (as in vLLM: logits divided by a smaller one overflow float32). Otherwise tokens
    are drawn from
    softmax(logits / temperature) restricted in vLLM's order: ``min_p`` keeps the tokens at least ``min_p``
    times as likely as the most likely (0: all) and ``top_k`` the ``top_k`` most likely (0: all), both
    measured on the whole distribution; then ``top_p`` keeps, of those, the smallest set reaching
    probability ``top_p`` of the distribution renormalized to them (1: all).
    ``repetition_penalty`` (HF: logits of tokens in the prompt or output divided by it when positive,
    multiplied when negative), ``presence_penalty`` and ``frequency_penalty`` (OpenAI: subtracted once
    per generated token kind / per occurrence). ``seed`` makes draws reproducible (same seed, prompt and
    parameters: same output); None draws a fresh seed. Generation stops at ``max_tokens``, at the model's
    end-of-sequence token (unless ``ignore_eos``), at ``stop_token_ids`` or when the text contains one of
    ``stop`` (which is left out of the text). ``max_tokens`` 0: the prompt alone (its ``prompt_logprobs``
    where asked; an echo that scores it), nothing generated: the token sampled after the prompt is dropped.

    ``logprobs`` (0 to :data:`MAX_LOGPROBS`; None: off): each output token's log-probability and that many
    of the most likely tokens at its position; ``prompt_logprobs`` likewise for every prompt token after
    the first (vLLM's names). Both are of the model's raw distribution: the log-softmax of its logits
    before temperature, penalties and truncation, as vLLM reports them.

    ``n`` (1 to :data:`MAX_SAMPLES`) parallel samples of the prompt, which runs once (the samples share its
    KV blocks); sample ``i`` draws with seed ``seed + i`` (mod 2**32, as vLLM's parallel sampling seeds
    its child requests), so sample 0 draws what the request draws with ``n`` = 1. ``best_of`` (``n`` to
    :data:`MAX_SAMPLES`; None: ``n``) samples are drawn and the ``n`` with the highest cumulative logprob
    of their tokens (as ``logprobs`` reports them) are returned, best first (vLLM v0's ``best_of``).

    ``structured``: a :class:`~batchgpu.llm.structured.StructuredOutput` the output must follow (a JSON
    schema, any JSON object, a grammar); only tokens it allows are drawn, on the device. ``tools``: a
    :class:`~batchgpu.llm.tools.ToolCalling` (chat prompts only): the functions are rendered into the
    prompt, the output held to calls where ``choice`` requires one, and the last piece carries the
    ``tool_calls`` parsed from it (not both ``structured`` and ``tools``).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: Sequence[str] = field(default_factory=tuple)
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    best_of: int | None = None
    structured: StructuredOutput | None = None
    tools: ToolCalling | None = None

    def __post_init__(self) -> None:
        _whole("max_tokens", self.max_tokens, 0)
        _real("temperature", self.temperature, 0.0, FLOAT32_MAX)
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        _whole("top_k", self.top_k, 0, INT32_MAX)
        _real("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _real("min_p", self.min_p, 0.0, 1.0)
        _real("repetition_penalty", self.repetition_penalty, 0.0, FLOAT32_MAX, low_open=True)
        _real("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _real("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None:
            _whole("seed", self.seed, 0, 2**32 - 1)
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise RequestError(f"stop must be a str or a list of str, got {brief(self.stop)}", "stop")
        object.__setattr__(self, "stop", tuple(stop))
        if not isinstance(self.stop_token_ids, (list, tuple)):
            shown = brief(self.stop_token_ids)
            raise RequestError(f"stop_token_ids must be a list of int, got {shown}", "stop_token_ids")
        for token in self.stop_token_ids:
            _whole("stop_token_ids", token, 0)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _whole(name, getattr(self, name), 0, MAX_LOGPROBS)
        _whole("n", self.n, 1, MAX_SAMPLES)
        if self.best_of is not None:
            _whole("best_of", self.best_of, self.n, MAX_SAMPLES)
        self._check_constraints()
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(f"ignore_eos must be true or false, got {brief(self.ignore_eos)}", "ignore_eos")

    def _check_constraints(self) -> None:
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise RequestError(
                f"structured must be a StructuredOutput, got {brief(self.structured)}", "response_format"
            )
        if self.tools is not None and not isinstance(self.tools, ToolCalling):
            raise RequestError(f"tools must be a ToolCalling, got {brief(self.tools)}", "tools")
        if self.structured is not None and self.tools is not None:
            raise RequestError("a request takes a structured output or tools, not both", "response_format")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def samples(self) -> int:
        """Sequences the request runs: ``best_of``, or ``n`` without it."""
        return self.best_of if self.best_of is not None else self.n


def _whole(name: str, value: object, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise RequestError(f"{name} must be an int {bounds}, got {brief(value)}", name)


def _real(name: str, value: object, low: float, high: float, *, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number, got {brief(value)}", name)
    if value < low or value > high or (low_open and value == low):
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise RequestError(f"{name} must be in {interval}, got {brief(value)}", name)
