"""The engine on Ray Serve (batchgpu.llm.ray_serve): a local Ray cluster started here (127.0.0.1, stopped
at the end) runs two engine replicas of a tiny Qwen3 model on the reference executor behind the
OpenAI-compatible ingress. Concurrent streamed requests through the official ``openai`` client all end
with the greedy ids a single engine gives; killing a replica mid-run loses no request that had not
started streaming, and fails the streaming ones with a clear error instead of hanging; clients that leave
(streamed or not) have their requests dropped by the replicas' engines at once."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.error
import urllib.request

import pytest

import batchgpu as bg

ray = pytest.importorskip("ray", reason="Ray is an optional peer: pip install 'batchgpu[ray]'")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from batchgpu.llm import Engine, SamplingParams  # noqa: E402
from batchgpu.llm.options import EngineOptions  # noqa: E402
from batchgpu.llm.ray_serve import ReplicaLostError, build_app, client_error, cpu_share  # noqa: E402

from .servers import first_event, free_port, opened  # noqa: E402
from .test_llama_variants import VARIANTS, random_weights, write_gguf  # noqa: E402

PROMPTS = [[3, 17, 42, 8], [5, 1, 29], [11, 12, 13, 14, 15], [40, 2], [7, 7, 7], [21, 33, 1, 9, 4, 6]]
TOKENS = 150  # long enough streams that a replica is killed while some of them run
CONTEXT = 160
LONG = 8000  # a request whose client leaves asks for this many tokens: many seconds of steps to run them all


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("ray") / "qwen3.gguf"
    write_gguf(path, "qwen3", random_weights(VARIANTS["qwen3"], 4), context_length=LONG + 192)
    return str(path)


@pytest.fixture(scope="module")
def greedy(model) -> list[list[int]]:
    """Each prompt's greedy ids from one engine in this process."""
    engine = Engine(model, bg.Device("reference"), max_batch=4, max_context=CONTEXT, block_size=16)
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    return [engine.complete(prompt, params).token_ids for prompt in PROMPTS]


@pytest.fixture(scope="module")
def cluster(model):
    """Ray on this machine with two engine replicas serving ``model``; its OpenAI base URL."""
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    options = EngineOptions(model=model, device="reference", max_batch=4, max_context=LONG + 192)
    serve.run(build_app(options, replicas=2, model_name="tiny"), name="batchgpu")  # returns once it runs
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        serve.shutdown()
        ray.shutdown()


async def stream_ids(client, prompt: list[int], streaming: set[int] | None = None, key: int = 0) -> list[int]:
    """The completion's token ids, streamed (via the text of a one-character-per-token vocabulary); ``key``
    joins ``streaming`` at the first piece."""
    stream = await client.completions.create(
        model="tiny", prompt=prompt, max_tokens=TOKENS, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    text: list[str] = []
    async for chunk in stream:
        if chunk.choices:
            if streaming is not None:
                streaming.add(key)
            text.append(chunk.choices[0].text)
    return [_token_id(c) for c in "".join(text)]


def _token_id(character: str) -> int:
    return ord(character) - ord("A") if character <= "Z" else ord(character) - ord("a") + 26


def test_concurrent_requests_through_two_replicas(cluster, greedy):
    async def main() -> list[list[int]]:
        client = openai.AsyncOpenAI(base_url=cluster, api_key="unused", timeout=120, max_retries=0)
        try:
            return await asyncio.gather(*(stream_ids(client, p) for p in PROMPTS * 2))
        finally:
            await client.close()

    assert asyncio.run(main()) == greedy * 2
    replicas = serve.status().applications["batchgpu"].deployments["engine"].replica_states
    assert replicas.get("RUNNING") == 2
    with urllib.request.urlopen(f"{cluster}/engine", timeout=30) as response:  # one replica's engine, all states
        status = json.load(response)
    assert status["replicas"] == {"RUNNING": 2} and status["running"] == 0 and "memory" in status, status


def test_clients_that_leave_free_the_replicas(cluster, greedy):
    """Streams closed after their first event, and requests not streamed closed once they run: the
    replicas' engines drop them at once (each would run for many seconds), and serve the next ones."""
    base = cluster.removesuffix("/v1")
    whole = [opened(base, "/v1/completions", long_completion(p, stream=False)) for p in PROMPTS[:2]]
    streamed = [opened(base, "/v1/completions", long_completion(p, stream=True)) for p in PROMPTS[2:4]]
    try:  # 4 requests: one replica's slots hold them all, wherever the router sends them
        for connection in streamed:  # by then the requests sent before run too
            first_event(connection)
    finally:
        for connection in whole + streamed:
            connection.close()
    deadline, idle = time.monotonic() + 10, 0
    while idle < 6:  # in a row: the router deals the status calls to both replicas
        now = engine_status(cluster)
        idle = idle + 1 if now["running"] == now["waiting"] == 0 else 0
        assert time.monotonic() < deadline, f"a replica still runs requests whose clients left: {now}"
        time.sleep(0.05)

    async def served() -> list[int]:
        async with openai.AsyncOpenAI(base_url=cluster, api_key="unused", timeout=120, max_retries=0) as client:
            return await stream_ids(client, PROMPTS[0])

    assert asyncio.run(served()) == greedy[0]


def long_completion(prompt: list[int], *, stream: bool) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
            "stream": stream}  # fmt: skip


def engine_status(cluster: str) -> dict:
    """The status of the engine replica the router picks."""
    with urllib.request.urlopen(f"{cluster}/engine", timeout=30) as response:
        return json.load(response)


def test_a_replica_killed_mid_run(cluster, greedy):
    """A replica killed while requests stream: every request ends (none hangs) either with the single
    engine's ids or, only if it had started streaming (its client saw a first piece), with an error saying
    its replica died after some tokens; requests that had not started are retried on the other replica."""

    async def main() -> tuple[list, set[int]]:
        client = openai.AsyncOpenAI(base_url=cluster, api_key="unused", timeout=120, max_retries=0)
        streaming: set[int] = set()
        try:
            prompts = PROMPTS * 4
            tasks = [asyncio.create_task(stream_ids(client, p, streaming, i)) for i, p in enumerate(prompts)]
            while not streaming:
                await asyncio.sleep(0.01)
            replicas = [a for a in ray.util.list_named_actors(all_namespaces=True) if "#engine#" in a["name"]]
            ray.kill(ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"]), no_restart=False)
            results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 180)
            return results, streaming
        finally:
            await client.close()

    results, started = asyncio.run(main())  # started: requests whose client saw a first piece
    expected = greedy * 4
    for i, (result, want) in enumerate(zip(results, expected)):
        if isinstance(result, BaseException):
            assert i in started, f"request {i} had not started streaming, yet failed: {result!r}"
            assert isinstance(result, openai.APIError), result
            assert re.search(r"the replica serving this request died after [1-9]\d* tokens", str(result)), result
        else:
            assert result == want


def test_the_ingress_answers_501_for_what_its_replicas_keep(cluster):
    """The ingress has no tokenizer nor metrics of its own (its replicas' engines keep them): 501 with
    OpenAI's error body, for vLLM's tokenizer endpoints and Prometheus' scrape alike."""
    base = cluster.removesuffix("/v1")
    for path, body in [("/tokenizer_info", None), ("/tokenize", b'{"prompt": "a"}'), ("/metrics", None)]:
        request = urllib.request.Request(base + path, data=body, headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(request, timeout=60)
        assert answer.value.code == 501, path
        assert json.loads(answer.value.read())["error"]["type"] == "server_error"


def test_replicas_on_cpus_share_the_cluster_cpus(cluster):
    """4 CPUs (this cluster's): 1 replica takes them all, 2 take 2 each, 3 take 1 (Ray gives a replica
    as many BLAS threads as CPUs: one CPU per replica would compute on one core)."""
    assert [cpu_share(n) for n in (1, 2, 3, 4, 8)] == [4.0, 2.0, 1.0, 1.0, 1.0]


def test_the_router_deals_a_burst_evenly_and_follows_completions():
    """LeastLoadedRouter on its own (no cluster): a burst of requests is dealt out evenly, each round of
    three covering the three replicas; a completion makes its replica the next choice."""
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve.request_router import RequestRouter

    from batchgpu.llm.ray_router import LeastLoadedRouter

    class Replica:  # what choose_replicas reads of a RunningReplica
        def __init__(self, name: str) -> None:
            self.replica_id = ReplicaID(unique_id=name, deployment_id=DeploymentID(name="engine", app_name="t"))

    router = LeastLoadedRouter.__new__(LeastLoadedRouter)  # its Ray-side state is not used by these methods
    router.initialize_state()
    replicas = [Replica("a"), Replica("b"), Replica("c")]

    def route() -> str:
        [[chosen]] = asyncio.run(router.choose_replicas(replicas))
        router.on_request_routed(None, chosen.replica_id, None)
        return chosen.replica_id.unique_id

    assert issubclass(LeastLoadedRouter, RequestRouter)
    burst = [route() for _ in range(9)]
    assert all(sorted(burst[i : i + 3]) == ["a", "b", "c"] for i in (0, 3, 6)), burst
    router.on_request_completed(replicas[1].replica_id, "request-1")
    assert route() == "b"
    router.on_request_completed(replicas[2].replica_id, "request-2")
    router.on_request_completed(replicas[2].replica_id, "request-3")
    assert [route(), route()] == ["c", "c"]


def test_a_full_engine_or_queue_behind_the_ingress_is_a_429_there() -> None:
    """A replica's refusal keeps its class and field across Ray (an OverloadedError was a plain RequestError,
    a 400, at the ingress), Ray's backpressure on the queue to the replicas is an OverloadedError; a lost
    replica and other failures are no client error."""
    from ray.exceptions import RayTaskError
    from ray.serve.exceptions import BackPressureError

    full = bg.OverloadedError("the engine is full: it holds 4 sequences")
    wrapped = RayTaskError("generate", "Traceback ...", full).as_instanceof_cause()
    for error in (full, wrapped):
        answer = client_error(error)
        assert type(answer) is bg.OverloadedError and str(answer) == str(full), answer
    long = client_error(bg.RequestError("prompt (300 tokens) + max_tokens (10) exceed", "prompt"))
    assert type(long) is bg.RequestError and long.param == "prompt"
    queued = client_error(BackPressureError(num_queued_requests=2, max_queued_requests=2))
    assert type(queued) is bg.OverloadedError and "max_queued_requests=2" in str(queued), queued
    assert client_error(ReplicaLostError("lost")) is None and client_error(RuntimeError("boom")) is None
