"""The engine on Ray Serve: one replica per device, many devices and machines behind one OpenAI-compatible
ingress.

- :class:`EngineReplica` (the ``engine`` deployment): each replica makes its own :class:`Engine` (its
  Device, resident weights and paged KV cache) in the replica's event-loop thread; ``num_gpus=1`` per
  replica on GPU machines (Ray gives each its GPU), a CPU share otherwise. Ray Serve health-checks it
  (``check_health``: the engine's scheduler must not have failed).
- :class:`OpenAIIngress` (the ``openai`` deployment): the same routes and streaming as ``batchgpu serve``
  (:func:`batchgpu.llm.server.create_app`) over :class:`RemoteEngine`, which sends each request through
  a Ray Serve handle to the replica with the fewest requests in flight
  (:class:`batchgpu.llm.ray_router.LeastLoadedRouter`).
- A request whose replica dies before its first piece is retried once on another replica; one that dies
  after it fails with :class:`ReplicaLostError` (the stream ends with an error event: clients never hang).
- A request whose client leaves is aborted as ``batchgpu serve`` aborts it: the ingress closes its
  :meth:`RemoteEngine.generate`, which cancels the replica's call, whose engine frees the request's slot.

:func:`build_app` assembles the application, :func:`run` serves it (``python -m batchgpu serve --ray
--replicas N``). Nothing else in batchgpu imports Ray but the router beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from ..errors import OverloadedError, RequestError
from .options import EngineOptions
from .output import Piece
from .params import SamplingParams
from .prompt import Prompt
from .schema import DEFAULT_MAX_REQUEST_BYTES


class ReplicaLostError(RequestError):
    """The replica serving a request died after the request had streamed part of its output."""


def assigned_adapter(kind: str | None) -> int | None:
    """For wgpu under Ray with GPUs: the index of the GPU Ray assigned to this replica (CUDA and HIP are
    narrowed by Ray's CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES already)."""
    if (kind or "wgpu") != "wgpu":
        return None
    import ray

    gpus = ray.get_gpu_ids() if ray.is_initialized() else []
    return int(gpus[0]) if gpus else None


def cpu_share(replicas: int) -> float:
    """CPUs per replica where replicas run on CPUs: the cluster's CPUs split evenly between the replicas,
    no more than one machine has, at least 1. Ray gives a replica's numpy (BLAS) and native code that
    many threads (``OMP_NUM_THREADS``), so a replica of one CPU computes on one core."""
    import ray

    nodes = [node["Resources"].get("CPU", 0.0) for node in ray.nodes() if node.get("Alive")]
    if not nodes:
        return 1.0
    return float(max(1, int(min(max(nodes), sum(nodes) / replicas))))


class EngineReplica:
    """One replica: an :class:`Engine` on its own device, streaming :class:`Piece` s of one request per
    ``generate`` call."""

    def __init__(self, options: dict[str, Any]) -> None:
        settings = EngineOptions(**options)
        self.engine = settings.make(adapter=assigned_adapter(settings.device))

    async def generate(self, prompt: Prompt, params: SamplingParams, trusted: bool = False) -> AsyncIterator[Piece]:
        """The request's pieces; a call Ray cancels (the ingress's client left) closes the engine's generation
        at once, whether Ray cancels the task iterating this or throws CancelledError in at a ``yield``."""
        async with contextlib.aclosing(self.engine.generate(prompt, params, trusted=trusted)) as pieces:
            async for piece in pieces:
                yield piece

    def status(self) -> dict[str, Any]:
        return self.engine.status()

    def check_health(self) -> None:
        """Ray Serve's health check: a scheduler task that ended with an error makes the replica unhealthy."""
        if self.engine.failure is not None:
            raise RuntimeError(f"the engine's scheduler failed: {self.engine.failure!r}")


class RemoteEngine:
    """What the HTTP app needs of an engine (``generate``, ``status``), served by the replicas behind a
    Ray Serve ``handle``."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.streaming = handle.options(stream=True)

    async def generate(self, prompt: Prompt, params: SamplingParams, *, trusted: bool = False) -> AsyncIterator[Piece]:
        """The request's pieces from one replica; retried once on another when the first dies before
        answering (``trusted``: as :meth:`Engine.generate`)."""
        for attempt in (1, 2):
            stream = self.streaming.generate.remote(prompt, params, trusted)
            try:
                first = await stream.__anext__()
            except StopAsyncIteration:
                return
            except Exception as exc:
                _reraise_request_error(exc)
                if attempt == 2 or not _replica_died(exc):
                    raise
                continue
            except BaseException:  # cancelled before the first piece (a client gone): so is the replica's work
                stream.cancel()
                raise
            try:
                yield first
                async for piece in _guarded(stream, first):
                    yield piece
            finally:  # a client gone (the ingress closes this generator): the replica cancels the request
                stream.cancel()
            return

    async def status(self) -> dict[str, Any]:
        """The engine status of the replica the router picks, and under ``replicas`` how many of the
        deployment's replicas are in each state (``{"RUNNING": 2}``)."""
        status = await self.handle.status.remote()
        states = await asyncio.to_thread(_replica_states, self.handle.app_name, self.handle.deployment_name)
        return {**status, "replicas": states}


def _replica_states(app: str, deployment: str) -> dict[str, int]:
    """The replicas of ``app``'s ``deployment`` per state, from the Serve controller."""
    from ray import serve

    replicas = serve.status().applications[app].deployments[deployment].replica_states
    return {str(state): count for state, count in replicas.items()}


async def _guarded(stream: Any, first: Piece) -> AsyncIterator[Piece]:
    """The rest of a stream; a replica death becomes :class:`ReplicaLostError`."""
    sent = len(first.token_ids)
    try:
        async for piece in stream:
            sent += len(piece.token_ids)
            yield piece
    except Exception as exc:
        _reraise_request_error(exc)
        if _replica_died(exc):
            raise ReplicaLostError(
                f"the replica serving this request died after {sent} tokens; retry the request"
            ) from exc
        raise


def _replica_died(exc: BaseException) -> bool:
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(exc, (ActorDiedError, ActorUnavailableError, RayActorError))


def _reraise_request_error(exc: BaseException) -> None:
    """Raise the client's error that ``exc`` stands for, if it stands for one (:func:`client_error`)."""
    error = client_error(exc)
    if error is not None:
        raise error from None


def client_error(exc: BaseException) -> RequestError | None:
    """The client's error that a failed call to a replica stands for: a request its engine refused (too
    long, bad ids, the engine full: the same class, so an :class:`~batchgpu.errors.OverloadedError` is a 429
    here too), or one Ray refused for its queue of requests to the replicas (``BackPressureError``:
    OverloadedError); None for other failures."""
    from ray.exceptions import RayTaskError
    from ray.serve.exceptions import BackPressureError

    cause = exc.cause if isinstance(exc, RayTaskError) else exc
    if isinstance(cause, BackPressureError):
        return OverloadedError(f"every engine replica is busy and the queue to them is full ({cause}): retry later")
    if isinstance(cause, RequestError) and not isinstance(cause, ReplicaLostError):
        return type(cause)(str(cause), cause.param)
    return None


class OpenAIIngress:
    """The HTTP ingress: batchgpu's OpenAI-compatible app over the replicas."""

    def __init__(self, engine: Any, model_name: str, settings: dict[str, Any] | None = None) -> None:
        self.remote = RemoteEngine(engine)
        self.model_name = model_name
        self.settings = settings or {}  # create_app's keywords: max_request_bytes, trusted_messages

    def __serve_build_asgi_app__(self) -> Any:
        from .server import create_app

        return create_app(lambda: self.remote, self.model_name, **self.settings)


def build_app(
    options: EngineOptions,
    *,
    replicas: int,
    model_name: str,
    gpus_per_replica: float = 0.0,
    cpus_per_replica: float | None = None,
    max_ongoing_requests: int | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    trusted_messages: bool = False,
) -> Any:
    """The Ray Serve application: ``replicas`` engine replicas (each with ``gpus_per_replica`` GPUs and
    ``cpus_per_replica`` CPUs; None: 1 beside a GPU, else :func:`cpu_share`) behind the OpenAI ingress
    (``max_request_bytes``, ``trusted_messages``: as :func:`batchgpu.llm.server.create_app`). Each replica
    takes ``max_ongoing_requests`` requests (default 4 per slot of ``max_batch``); with ``options.max_waiting``
    set, at most that many more (at least 1) wait in the ingress for a replica (Ray's ``max_queued_requests``)
    and the next ones are refused with 429, as each replica's engine refuses past its own bound."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from .ray_router import LeastLoadedRouter

    if replicas < 1:
        raise RequestError(f"build_app: replicas must be at least 1, got {replicas}")
    if cpus_per_replica is None:
        cpus_per_replica = 1.0 if gpus_per_replica > 0 else cpu_share(replicas)
    per_replica = max_ongoing_requests or 4 * options.max_batch
    engine = serve.deployment(
        EngineReplica,
        name="engine",
        num_replicas=replicas,
        ray_actor_options={"num_gpus": gpus_per_replica, "num_cpus": cpus_per_replica},
        max_ongoing_requests=per_replica,
        max_queued_requests=-1 if options.max_waiting is None else max(1, options.max_waiting),
        request_router_config=RequestRouterConfig(request_router_class=LeastLoadedRouter),
        health_check_period_s=5,
        health_check_timeout_s=30,
    )
    ingress = serve.deployment(  # Ray's default (5 requests at once) would throttle every replica behind it
        serve.ingress()(OpenAIIngress),
        name="openai",
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=replicas * per_replica,
    )
    settings = {"max_request_bytes": max_request_bytes, "trusted_messages": trusted_messages}
    return ingress.bind(engine.bind(asdict(options)), model_name, settings)


def run(
    options: EngineOptions,
    *,
    replicas: int,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    address: str | None = None,
    gpus_per_replica: float | None = None,
    cpus_per_replica: float | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    trusted_messages: bool = False,
) -> None:
    """Join (``address``) or start a Ray cluster and serve the application on ``host:port`` until
    interrupted; ``gpus_per_replica`` defaults to 1 where the cluster has GPUs, else 0 (and then each
    replica gets an even share of the CPUs, :func:`cpu_share`); the other settings as :func:`build_app`."""
    import ray
    from ray import serve

    ray.init(address=address, include_dashboard=False)
    if gpus_per_replica is None:
        gpus_per_replica = 1.0 if ray.cluster_resources().get("GPU", 0) >= 1 else 0.0
    serve.start(http_options={"host": host, "port": port})
    app = build_app(
        options,
        replicas=replicas,
        model_name=model_name,
        gpus_per_replica=gpus_per_replica,
        cpus_per_replica=cpus_per_replica,
        max_request_bytes=max_request_bytes,
        trusted_messages=trusted_messages,
    )
    serve.run(app, name="batchgpu", blocking=True)
