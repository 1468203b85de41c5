"""The engine's Prometheus metrics (batchgpu/llm/metrics.py) without a model: a real scheduler and block
pool behind the collector, each registry its own (two engines in one process do not mix, and nothing goes
to prometheus_client's default registry), histogram buckets by Prometheus' ``le`` rule, and the
scheduler's preemption and prefix-cache counts read from its stats. The server tests
(tests/test_server.py -k metrics) scrape a running server after real requests."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from batchgpu.llm.blocks import BlockPool
from batchgpu.llm.metrics import (
    TIME_TO_FIRST_TOKEN_BUCKETS,
    EngineStats,
    Histogram,
    Load,
    exposition,
    metrics_registry,
)
from batchgpu.llm.params import SamplingParams
from batchgpu.llm.scheduler import Scheduler

prometheus_client = pytest.importorskip("prometheus_client", reason="pip install 'batchgpu[serve]'")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


@dataclass
class Core:
    """What the collector reads of an engine, without the model: a scheduler over a block pool and the
    token stats."""

    pool: BlockPool = field(default_factory=lambda: BlockPool(13, 4))
    stats: EngineStats = field(default_factory=EngineStats)

    def __post_init__(self) -> None:
        self.scheduler = Scheduler(self.pool, max_batch=2, max_context=40, max_step_tokens=8)

    def load(self) -> Load:
        return Load.of(self.scheduler, self.pool)


def scrape(registry) -> dict[str, float]:
    body, content_type = exposition(registry)
    assert content_type.startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            label = sample.labels.get("le", sample.labels.get("finished_reason"))
            samples[sample.name + (f"[{label}]" if label is not None else "")] = sample.value
    return samples


def test_two_engines_keep_their_own_registries():
    """Two cores in one process, each with its own registry: each scrape reads its own scheduler, pool and
    stats at that moment, and prometheus_client's default registry holds none of it."""
    first, second = Core(), Core()
    registries = metrics_registry(first), metrics_registry(second)
    for prompt in ([5, 6, 7], [8] * 9, [1] * 20):
        first.scheduler.add(prompt, SamplingParams(max_tokens=3), seed=1)
    first.scheduler.schedule()  # two admitted (slots), one waiting
    first.stats.first_token(0.02)
    first.stats.next_token(0.01)
    first.stats.finish(3, 2, ["stop"])
    one, two = (scrape(registry) for registry in registries)
    assert (one["batchgpu_requests_running"], one["batchgpu_requests_waiting"]) == (2, 1)
    assert one["batchgpu_kv_blocks_used_ratio"] == first.pool.used / 13 and first.pool.used > 0
    assert (one["batchgpu_prompt_tokens_total"], one["batchgpu_generation_tokens_total"]) == (3, 2)
    assert (one["batchgpu_requests_finished_total"], one["batchgpu_request_success_total[stop]"]) == (1, 1)
    assert one["batchgpu_time_to_first_token_seconds_count"] == one["batchgpu_inter_token_latency_seconds_count"] == 1
    assert two["batchgpu_requests_running"] == two["batchgpu_kv_blocks_used_ratio"] == 0
    assert two["batchgpu_generation_tokens_total"] == two["batchgpu_time_to_first_token_seconds_count"] == 0
    assert not any(name.startswith("batchgpu_") for name in scrape(prometheus_client.REGISTRY))


def test_histogram_buckets_follow_the_le_rule():
    """A value equal to a bound counts in that bucket, one between bounds in the next, one above every
    bound only in +Inf; the sum is the values' sum."""
    histogram = Histogram(TIME_TO_FIRST_TOKEN_BUCKETS)
    for value in (0.001, 0.0011, 0.0, 3000.0, 2560.0):
        histogram.observe(value)
    buckets = dict(histogram.cumulative())
    assert (buckets["0.001"], buckets["0.005"], buckets["2560.0"], buckets["+Inf"]) == (2, 3, 4, 5)
    assert list(buckets) == [*map(str, TIME_TO_FIRST_TOKEN_BUCKETS), "+Inf"]
    assert histogram.sum == pytest.approx(5560.0021)


def test_preemptions_and_prefix_hits_come_from_the_schedulers_stats():
    """Preemptions and prefix-cache hit tokens are the scheduler's own counters (``SchedulerStats``),
    exported as counters at scrape time."""
    core = Core()
    assert scrape(metrics_registry(core))["batchgpu_preemptions_total"] == 0
    core.scheduler.stats.preemptions, core.scheduler.stats.prefix_cache_hit_tokens = 3, 48
    samples = scrape(metrics_registry(core))
    assert (samples["batchgpu_preemptions_total"], samples["batchgpu_prefix_cache_hit_tokens_total"]) == (3, 48)


def test_requests_by_outcome_are_counters():
    """Requests by outcome (finished, aborted, overloaded, refused, failed) and the finished ones' choices by
    finish reason, from the engine's stats; all Prometheus counters, the token counters the finished
    requests' usage."""
    core = Core()
    core.stats.overloaded, core.stats.aborted = 2, 3
    for outcome in ("refused", "refused", "failed", "aborted"):
        core.stats.end(outcome)
    core.stats.finish(7, 5, ["stop", "length", "length"])
    core.stats.finish(4, 0, ["length"])
    core.stats.finish(2, 9, ["tool_calls"])
    body, _ = exposition(metrics_registry(core))
    kinds = {family.name: family.type for family in text_string_to_metric_families(body.decode())}
    outcomes = ("finished", "aborted", "overloaded", "refused", "failed")
    assert {kinds[f"batchgpu_requests_{outcome}"] for outcome in outcomes} == {"counter"}
    assert kinds["batchgpu_request_success"] == "counter"
    samples = scrape(metrics_registry(core))
    assert [samples[f"batchgpu_requests_{outcome}_total"] for outcome in outcomes] == [3, 4, 2, 2, 1]
    reasons = [samples[f"batchgpu_request_success_total[{reason}]"] for reason in ("stop", "length", "tool_calls")]
    assert reasons == [1, 3, 1]
    assert (samples["batchgpu_prompt_tokens_total"], samples["batchgpu_generation_tokens_total"]) == (13, 14)
