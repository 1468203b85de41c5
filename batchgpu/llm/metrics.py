"""An engine's Prometheus metrics. The engine keeps plain counts (:class:`EngineStats`: prompt and generated
tokens, time to first token and between tokens, recorded by each request's output processor as its tokens
are delivered); :func:`metrics_registry` gives a prometheus_client registry of the engine's own (never the
process-wide default, so two servers in one process do not mix) whose collector reads those counts, the
scheduler's queues and the KV block pool at each scrape: no work on the engine's side between scrapes, and
a scrape reads a few dozen numbers on the event loop.

- gauges: ``batchgpu_requests_running``, ``batchgpu_requests_waiting``, ``batchgpu_kv_blocks_used_ratio``;
- counters: ``batchgpu_prompt_tokens_total``, ``batchgpu_generation_tokens_total``,
  ``batchgpu_prefix_cache_hit_tokens_total``, ``batchgpu_preemptions_total``,
  ``batchgpu_requests_overloaded_total``, ``batchgpu_requests_aborted_total`` (counted by the server:
  requests whose client left before their answer was whole, each cancelled at once),
  ``batchgpu_steps_total`` (label ``kind``: ``decode``, ``mixed``, ``verify``),
  ``batchgpu_spec_decode_num_draft_tokens_total``, ``batchgpu_spec_decode_num_accepted_tokens_total``
  (speculative decoding: tokens drafted into verify steps, and of them those accepted; vLLM's names);
- histograms: ``batchgpu_time_to_first_token_seconds``, ``batchgpu_inter_token_latency_seconds``,
  ``batchgpu_iteration_tokens`` (token rows per step: vLLM's ``iteration_tokens_total``; vLLM's bucket
  bounds).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .blocks import BlockPool
from .scheduler import Scheduler

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
    """What an engine's requests got since it started: prompt tokens (counted at each request's first
    token), generated tokens delivered, the seconds from a request's arrival to its first token and
    between its following tokens; the steps it ran per kind and their token rows."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    overloaded: int = 0  # requests refused because the engine was full (OverloadedError: the server's 429)
    aborted: int = 0  # requests the server cancelled because their client left (disconnected, or a send failed)
    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(TIME_TO_FIRST_TOKEN_BUCKETS))
    inter_token_latency: Histogram = field(default_factory=lambda: Histogram(INTER_TOKEN_LATENCY_BUCKETS))
    steps: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STEP_KINDS, 0))
    iteration_tokens: Histogram = field(default_factory=lambda: Histogram(ITERATION_TOKEN_BUCKETS))

    def first_token(self, prompt_tokens: int, seconds: float) -> None:
        """A request's first token, ``seconds`` after it arrived, for a prompt of ``prompt_tokens``."""
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += 1
        self.time_to_first_token.observe(seconds)

    def next_token(self, seconds: float) -> None:
        """A later token of a request, ``seconds`` after its previous one."""
        self.generation_tokens += 1
        self.inter_token_latency.observe(seconds)

    def step(self, kind: str, rows: int) -> None:
        """A step of ``kind`` submitted, over ``rows`` token rows."""
        self.steps[kind] += 1
        self.iteration_tokens.observe(rows)


class MeteredEngine(Protocol):
    """What the collector reads of an :class:`~batchgpu.llm.engine.Engine`."""

    stats: EngineStats
    scheduler: Scheduler  # running(), waiting, stats
    pool: BlockPool  # used, blocks


class EngineCollector:
    """A prometheus_client collector: the metrics of ``engine``, read when scraped."""

    def __init__(self, engine: MeteredEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        engine, stats, counts = self.engine, self.engine.stats, self.engine.scheduler.stats
        preemptions, prefix_hits = counts.preemptions, counts.prefix_cache_hit_tokens
        gauges = (
            ("requests_running", "Requests holding a slot (prefilling or decoding).", len(engine.scheduler.running())),
            ("requests_waiting", "Requests waiting for a slot and KV blocks.", len(engine.scheduler.waiting)),
            ("kv_blocks_used_ratio", "KV blocks in use / all KV blocks.", engine.pool.used / engine.pool.blocks),
        )
        for name, text, value in gauges:
            yield GaugeMetricFamily(f"batchgpu_{name}", text, value=value)
        counters = (
            ("prompt_tokens", "Prompt tokens of requests that got their first token.", stats.prompt_tokens),
            ("generation_tokens", "Generated tokens delivered to requests.", stats.generation_tokens),
            ("prefix_cache_hit_tokens", "Prompt tokens whose KV came from the prefix cache.", prefix_hits),
            ("preemptions", "Sequences preempted (KV blocks freed, recomputed later).", preemptions),
            ("requests_overloaded", "Requests refused because the engine was full (429).", stats.overloaded),
            ("spec_decode_num_draft_tokens", "Tokens drafted into verify steps read back.", counts.drafted_tokens),
            ("spec_decode_num_accepted_tokens", "Drafted tokens accepted.", counts.accepted_tokens),
            ("requests_aborted", "Requests cancelled because their client disconnected.", stats.aborted),
        )
        for name, text, value in counters:
            yield CounterMetricFamily(f"batchgpu_{name}", text, value=value)
        steps = CounterMetricFamily("batchgpu_steps", "Steps run, by kind (decode only, or mixed).", labels=["kind"])
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
