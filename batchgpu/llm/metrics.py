"""An engine's Prometheus metrics. The engine keeps plain counts (:class:`EngineStats`: requests by outcome,
their prompt and generated tokens, time to first token and between tokens); :func:`metrics_registry` gives a
prometheus_client registry of the engine's own (never the process-wide default, so two servers in one
process do not mix) whose collector reads those counts, the scheduler's queues and the KV block pool at each
scrape: no work on the engine's side between scrapes, and a scrape reads a few dozen numbers on the event
loop.

The request counters agree with the answers: every generation request ends with one outcome, counted once
where it is decided, and the token counters are the sums of the ``usage`` the finished requests' answers
report (counted as a request's last piece goes to its caller, from the usage that piece carries).

- gauges: ``batchgpu_requests_running``, ``batchgpu_requests_waiting``, ``batchgpu_kv_blocks_used_ratio``;
- counters of requests by outcome: ``batchgpu_requests_finished_total`` (answered whole: a response, or a
  stream to its end), ``batchgpu_requests_aborted_total`` (cancelled by their caller before they finished:
  a client that left, each cancelled at once), ``batchgpu_requests_overloaded_total`` (refused because the
  engine was full: 429), ``batchgpu_requests_refused_total`` (refused as invalid: the engine's RequestError
  before it queued them, and the server's 400/404/413 for a body it would not take),
  ``batchgpu_requests_failed_total`` (an error ended them after they were queued: a grammar that could not
  go on, a step that failed); ``batchgpu_request_success_total`` (label ``finished_reason``: ``stop``,
  ``length``, ``tool_calls``): the choices the finished requests returned, by finish reason (a request of
  ``n`` counts ``n``, as vLLM v1 counts each parallel sample);
- counters of tokens: ``batchgpu_prompt_tokens_total`` and ``batchgpu_generation_tokens_total`` (the
  finished requests' ``usage.prompt_tokens`` and ``usage.completion_tokens``: the prompt once per request,
  every returned choice's tokens; an aborted or failed request's tokens are in neither),
  ``batchgpu_prefix_cache_hit_tokens_total``, ``batchgpu_preemptions_total``, ``batchgpu_steps_total``
  (label ``kind``: ``decode``, ``mixed``, ``verify``), ``batchgpu_spec_decode_num_draft_tokens_total`` and
  ``batchgpu_spec_decode_num_accepted_tokens_total`` (speculative decoding: tokens drafted into verify steps,
  and of them those accepted; vLLM's names);
- histograms: ``batchgpu_time_to_first_token_seconds`` (one per request that got its first token, or with
  ``max_tokens`` 0 its prompt scored), ``batchgpu_inter_token_latency_seconds`` (these two as tokens are
  delivered, so also for requests aborted later), ``batchgpu_iteration_tokens`` (token rows per step: vLLM's
  ``iteration_tokens_total``; vLLM's bucket bounds).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .blocks import BlockPool
from .scheduler import Scheduler, SchedulerStats

TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)  # fmt: skip
"""Upper bounds (seconds) of the time-to-first-token buckets: vLLM's ``vllm:time_to_first_token_seconds``."""

INTER_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
"""Upper bounds (seconds) of the inter-token latency buckets: vLLM's ``vllm:inter_token_latency_seconds``."""


ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
"""Upper bounds of the tokens-per-step buckets: vLLM's ``vllm:iteration_tokens_total``."""

STEP_KINDS = ("decode", "mixed", "verify")
"""The step kinds counted (:class:`~batchgpu.llm.scheduler.StepKind`'s values)."""

OUTCOMES = ("finished", "aborted", "overloaded", "refused", "failed")
"""How a generation request ends (the ``batchgpu_requests_<outcome>_total`` counters)."""

FINISH_REASONS = ("stop", "length", "tool_calls")
"""The finish reasons of returned choices (``batchgpu_request_success_total``'s ``finished_reason``)."""


def clock() -> float:
    """Seconds on the clock latencies are measured with (``time.monotonic``)."""
    return time.monotonic()


class Histogram:
    """Observations (seconds, tokens) counted in buckets of fixed upper bounds (Prometheus' ``le``: a value
    equal to a bound is in that bucket), and their sum."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, int]]:
        """(upper bound as Prometheus writes it, ``1.0``; observations at or below it) per bucket, ending with
        ``+Inf`` (every observation)."""
        buckets, total = [], 0
        for bound, count in zip([*(str(float(bound)) for bound in self.bounds), "+Inf"], self.counts):
            total += count
            buckets.append((bound, total))
        return buckets


@dataclass
class EngineStats:
    """What an engine's requests got since it started: requests by outcome (:data:`OUTCOMES`), the prompt and
    generated tokens the finished ones' answers report and their choices by finish reason, the seconds from
    a request's arrival to its first token and between its following tokens; the steps it ran per kind and
    their token rows."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: int = 0  # requests answered whole (their usage is in the token counts)
    aborted: int = 0  # requests cancelled by their caller before they finished (a client that left)
    overloaded: int = 0  # requests refused because the engine was full (OverloadedError: the server's 429)
    refused: int = 0  # requests refused as invalid (a RequestError before they were queued; the server's 4xx)
    failed: int = 0  # requests an error ended after they were queued
    finish_reasons: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(TIME_TO_FIRST_TOKEN_BUCKETS))
    inter_token_latency: Histogram = field(default_factory=lambda: Histogram(INTER_TOKEN_LATENCY_BUCKETS))
    steps: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STEP_KINDS, 0))
    iteration_tokens: Histogram = field(default_factory=lambda: Histogram(ITERATION_TOKEN_BUCKETS))

    def first_token(self, seconds: float) -> None:
        """A request's first token (with ``max_tokens`` 0: its prompt scored), ``seconds`` after it arrived."""
        self.time_to_first_token.observe(seconds)

    def next_token(self, seconds: float) -> None:
        """A later token of a request, ``seconds`` after its previous one."""
        self.inter_token_latency.observe(seconds)

    def finish(self, prompt_tokens: int, completion_tokens: int, reasons: Sequence[str]) -> None:
        """A request answered whole, with the usage its answer reports and its choices' finish reasons."""
        self.finished += 1
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += completion_tokens
        for reason in reasons:
            self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1

    def end(self, outcome: str) -> None:
        """A request that ended otherwise: ``aborted``, ``overloaded``, ``refused`` or ``failed``."""
        assert outcome in OUTCOMES and outcome != "finished", outcome
        setattr(self, outcome, getattr(self, outcome) + 1)

    def step(self, kind: str, rows: int) -> None:
        """A step of ``kind`` submitted, over ``rows`` token rows."""
        self.steps[kind] += 1
        self.iteration_tokens.observe(rows)


@dataclass
class Load:
    """What an engine's core holds now: sequences running (holding a slot) and waiting, the share of its KV
    blocks in use, and its scheduler's counters."""

    running: int = 0
    waiting: int = 0
    kv_used_ratio: float = 0.0
    counts: SchedulerStats = field(default_factory=SchedulerStats)

    @classmethod
    def of(cls, scheduler: Scheduler, pool: BlockPool) -> Load:
        return cls(len(scheduler.running()), len(scheduler.waiting), pool.used / pool.blocks, scheduler.stats)


class MeteredEngine(Protocol):
    """What the collector reads of an engine (:class:`~batchgpu.llm.engine.Engine`,
    :class:`~batchgpu.llm.engine_process.EngineProcess`)."""

    stats: EngineStats

    def load(self) -> Load: ...


class EngineCollector:
    """A prometheus_client collector: the metrics of ``engine``, read when scraped."""

    def __init__(self, engine: MeteredEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        load, stats = self.engine.load(), self.engine.stats
        counts = load.counts
        preemptions, prefix_hits = counts.preemptions, counts.prefix_cache_hit_tokens
        gauges = (
            ("requests_running", "Requests holding a slot (prefilling or decoding).", load.running),
            ("requests_waiting", "Requests waiting for a slot and KV blocks.", load.waiting),
            ("kv_blocks_used_ratio", "KV blocks in use / all KV blocks.", load.kv_used_ratio),
        )
        for name, text, value in gauges:
            yield GaugeMetricFamily(f"batchgpu_{name}", text, value=value)
        counters = (
            ("prompt_tokens", "Prompt tokens the finished requests' usage reports.", stats.prompt_tokens),
            ("generation_tokens", "Completion tokens the finished requests' usage reports.", stats.generation_tokens),
            ("prefix_cache_hit_tokens", "Prompt tokens whose KV came from the prefix cache.", prefix_hits),
            ("preemptions", "Sequences preempted (KV blocks freed, recomputed later).", preemptions),
            ("requests_finished", "Requests answered whole.", stats.finished),
            ("requests_aborted", "Requests cancelled before they finished (their client left).", stats.aborted),
            ("requests_overloaded", "Requests refused because the engine was full (429).", stats.overloaded),
            ("requests_refused", "Requests refused as invalid (400, 404, 413).", stats.refused),
            ("requests_failed", "Requests an error ended after they were queued.", stats.failed),
            ("spec_decode_num_draft_tokens", "Tokens drafted into verify steps read back.", counts.drafted_tokens),
            ("spec_decode_num_accepted_tokens", "Drafted tokens accepted.", counts.accepted_tokens),
        )
        for name, text, value in counters:
            yield CounterMetricFamily(f"batchgpu_{name}", text, value=value)
        success = CounterMetricFamily(
            "batchgpu_request_success", "Choices of finished requests, by finish reason.", labels=["finished_reason"]
        )
        for reason, count in stats.finish_reasons.items():
            success.add_metric([reason], count)
        yield success
        steps = CounterMetricFamily("batchgpu_steps", "Steps run, by kind (decode, mixed, verify).", labels=["kind"])
        for kind, count in stats.steps.items():
            steps.add_metric([kind], count)
        yield steps
        histograms = (
            ("time_to_first_token_seconds", "Seconds from a request's arrival to its first token.",
             stats.time_to_first_token),
            ("inter_token_latency_seconds", "Seconds between a request's consecutive tokens.",
             stats.inter_token_latency),
            ("iteration_tokens", "Token rows per step (decode rows and prompt rows).", stats.iteration_tokens),
        )  # fmt: skip
        for name, text, histogram in histograms:
            yield HistogramMetricFamily(
                f"batchgpu_{name}", text, buckets=histogram.cumulative(), sum_value=histogram.sum
            )


def metrics_registry(engine: MeteredEngine) -> Any:
    """A new ``prometheus_client.CollectorRegistry`` holding ``engine``'s metrics (ImportError without
    prometheus-client: ``pip install 'batchgpu[serve]'``)."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    return registry


def exposition(registry: Any) -> tuple[bytes, str]:
    """The text a scrape of ``registry`` gets (Prometheus' text format) and its content type."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return generate_latest(registry), CONTENT_TYPE_LATEST
