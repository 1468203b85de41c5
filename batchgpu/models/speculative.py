"""Speculative decoding's model-independent parts: how it is asked for (:class:`Speculative`: prompt lookup
or a draft model, up to ``tokens`` drafted tokens a step), the prompt-lookup drafter (the n-gram match of
the latest tokens in the prompt and output so far, as llama.cpp's ``--lookup`` and vLLM's ``ngram``
method) and the rule that keeps the longest accepted prefix of a draft.

A verify step runs the latest token and the k drafted ones as k + 1 rows and samples a token from each row
with the target model's distribution (greedy, or a draw keyed by the request's seed and the output
position, as every other step draws): drafted token ``i`` is accepted while it equals what row ``i``
sampled, and the first row that disagrees gives one more token. For a draft that is one token per position
(prompt lookup, a draft model drafting greedily), this is the standard rejection sampling (Leviathan et
al., Chen et al.) with a one-hot draft distribution: the token is accepted with the target's probability of
it, and a rejected one is replaced by a draw from the target's distribution without it; so the output has
the target's distribution, and, with the same keyed draws, is the same tokens a run without speculation
samples."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ArgumentError

METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class Speculative:
    """Speculative decoding: ``method`` ``"ngram"`` (prompt lookup: a match of the last ``max_ngram`` down to
    ``min_ngram`` tokens earlier in the prompt and output proposes the tokens that followed it) or
    ``"draft"`` (``draft``: another model's file with the same vocabulary, run on the same device, drafting
    greedily), up to ``tokens`` drafted tokens per step. An engine speculates only while at most
    ``max_batch`` sequences decode (past that a step is full without it) and for requests without
    repetition, presence or frequency penalties (their counts would take the drafted tokens)."""

    method: str = "ngram"
    tokens: int = 4
    min_ngram: int = 2
    max_ngram: int = 4
    draft: str | Path | None = None
    max_batch: int = 16

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ArgumentError(f"Speculative: method must be one of {', '.join(METHODS)}, got {self.method!r}")
        for name in ("tokens", "min_ngram", "max_ngram", "max_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ArgumentError(f"Speculative: {name} must be an int >= 1, got {value!r}")
        if self.min_ngram > self.max_ngram:
            raise ArgumentError(f"Speculative: min_ngram ({self.min_ngram}) exceeds max_ngram ({self.max_ngram})")
        if (self.method == "draft") != (self.draft is not None):
            raise ArgumentError("Speculative: a draft model file goes with method 'draft', and only with it")

    @classmethod
    def parse(cls, text: str) -> Speculative:
        """``ngram:K`` or ``draft:PATH:K`` (``serve --speculative``); ArgumentError naming the form otherwise."""
        method, _, rest = text.partition(":")
        path, _, tokens = rest.rpartition(":") if method == "draft" else ("", "", rest)
        if method not in METHODS or not tokens.isdigit() or (method == "draft") != bool(path):
            raise ArgumentError(f"--speculative must be ngram:K or draft:PATH:K (K >= 1 tokens), got {text!r}")
        return cls(method, int(tokens), draft=path or None)


def prompt_lookup(tokens: Sequence[int] | np.ndarray, limit: int, min_ngram: int, max_ngram: int) -> list[int]:
    """Up to ``limit`` tokens that followed the latest earlier occurrence of the last n tokens of ``tokens``
    (n from ``max_ngram`` down to ``min_ngram``; the first n that matches anywhere); none without a match."""
    ids = np.asarray(tokens, np.int64)
    length = ids.size
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(ids[: length - 1], n)  # every n-gram but the tail
        matches = np.flatnonzero((windows == ids[length - n :]).all(axis=1))
        if matches.size:
            start = int(matches[-1]) + n  # after the latest match
            return ids[start : start + limit].tolist()
    return []


def accepted(draft: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The tokens a verify step gives: ``sampled[i]`` is what row ``i`` (the latest token, then each drafted
    one) sampled; drafted tokens count while they equal what the row before sampled, then one more token
    (the first disagreement, or the row after the last drafted token)."""
    count = 0
    while count < len(draft) and draft[count] == sampled[count]:
        count += 1
    return list(sampled[: count + 1])
