"""benchmarks/serve_load.py's in-process path on tiny-llama (synthetic) on the reference executor: a few
requests of exact lengths, all at once and (with a shared prefix) Poisson; the figures must add up: every
token generated, every step counted, the first token of each request from its prompt's step and the rest
from decode rows, the rows the prompts and decodes need, and occupancies that are fractions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from .conftest import load_script

pytest.importorskip("gguf", reason="the synthetic file is written with the gguf package")

REQUESTS, PROMPT, TOKENS = 4, 12, 8


def serve_load():
    """benchmarks/serve_load.py as a module (it puts its folder on sys.path for its neighbours)."""
    return load_script("benchmarks/serve_load.py", "serve_load_benchmark")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    from batchgpu.models.synth import write_synthetic

    folder = tmp_path_factory.mktemp("serve-load")
    return write_synthetic(folder / "tiny-llama.gguf", "tiny-llama", "q8_0", show=False).path


def tiny_trace(shared_prefix: int = 0, rate: float | None = None):
    module = serve_load()
    lengths = module.Lengths.parse
    return module.Trace("tiny", REQUESTS, lengths(str(PROMPT)), lengths(str(TOKENS)), shared_prefix, rate)


def test_a_trace_is_reproducible_distinct_and_shares_only_its_prefix():
    trace = tiny_trace(shared_prefix=20, rate=50.0)
    first, again, other = trace.draw(3), trace.draw(3), trace.draw(4)
    assert first == again and first != other
    assert all(len(r.prompt) == 20 + PROMPT and r.max_tokens == TOKENS for r in first)
    assert len({tuple(r.prompt[:20]) for r in first}) == 1 and len({tuple(r.prompt[20:]) for r in first}) == REQUESTS
    arrivals = [r.arrival for r in first]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals) and arrivals[-1] > 0
    lengths = serve_load().Lengths.parse("lognormal:20:0.5:30").draw(np.random.default_rng(0), 200)
    assert min(lengths) >= 1 and max(lengths) <= 30 and len(set(lengths)) > 5


@pytest.mark.parametrize(("shared_prefix", "rate"), [(0, None), (32, 100.0)], ids=["all-at-once", "poisson-prefix"])
def test_the_in_process_figures_add_up(model, shared_prefix, rate):
    module = serve_load()
    trace = tiny_trace(shared_prefix, rate)
    settings = module.Settings(max_batch=REQUESTS, max_context=64, kv_blocks=REQUESTS * 4)
    figures = module.measure_in_process("reference", model, trace, settings, seed=0)

    assert figures["tokens"] == REQUESTS * TOKENS
    assert figures["steps"] > 0 and sum(figures["steps_by_kind"].values()) == figures["steps"]
    decode_rows = round(figures["decode_rows_per_step"] * figures["steps"])
    assert decode_rows == REQUESTS * (TOKENS - 1)  # each request's first token comes from its prompt's step
    cached = figures["cached_prompt_tokens"]  # whole blocks of the shared prefix, for requests after the first
    assert cached % 16 == 0 and cached <= (REQUESTS - 1) * shared_prefix
    prompt_rows = REQUESTS * (shared_prefix + PROMPT) - cached
    assert round(figures["rows_per_step"] * figures["steps"]) == prompt_rows + decode_rows
    assert figures["prompt_rows"] == prompt_rows
    assert 0 < figures["occupancy"] <= 1
    for key in ("tokens_per_s", "ttft_p50_ms", "itl_p50_ms", "host_us_per_step", "cpu_ms_per_token"):
        assert figures[key] > 0 and math.isfinite(figures[key]), key
    assert figures["ttft_p50_ms"] <= figures["ttft_p99_ms"] and figures["itl_p50_ms"] <= figures["itl_p99_ms"]


def test_the_step_budget_goes_where_the_engine_takes_it():
    module = serve_load()

    class Old:
        def __init__(self, *, prefill_chunk: int = 32) -> None: ...

    class New:
        def __init__(self, *, max_step_tokens: int = 512) -> None: ...

    assert module.engine_budget(Old, None) == {} == module.engine_budget(New, None)
    assert module.engine_budget(Old, 64) == {"prefill_chunk": 64}
    assert module.engine_budget(New, 64) == {"max_step_tokens": 64}


def test_the_server_with_its_core_in_a_process_of_its_own_serves_the_trace(model):
    """``--split``'s second mode: ``serve --engine-process``, every token and step counted, and the CPU time
    of the server and its core process."""
    pytest.importorskip("openai", reason="the load generator is the openai client")
    pytest.importorskip("uvicorn", reason="pip install 'batchgpu[serve]'")
    module = serve_load()
    settings = module.Settings(max_batch=REQUESTS, max_context=64, kv_blocks=REQUESTS * 4)
    figures = module.measure_http_split("reference", model, tiny_trace(), settings, seed=0)
    assert figures["mode"] == "http-split" and figures["tokens"] == REQUESTS * TOKENS
    assert figures["steps"] > 0 and sum(figures["steps_by_kind"].values()) == figures["steps"]
    assert figures["cpu_ms_per_token"] > 0 and math.isfinite(figures["cpu_ms_per_token"])
