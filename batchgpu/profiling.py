"""Per-op timing of a batch: ``batch.execute(profile=True)``, ``batch.profile()``, ``batch.save_trace()``.

A :class:`Session` is filled while one execute runs: the batch notes its record calls and planning,
the executor its upload, encode (CUDA/HIP: launch) and submit, and the GPU time of every dispatch
(wgpu: timestamp queries around each dispatch inside the one compute pass, resolved into the same
readback submit; CUDA/HIP: timing events recorded on the stream before the first launch and after
each launch, issued eagerly instead of replaying the graph, :mod:`batchgpu.executors.native_timing`)
or the host time of every op (the numpy reference executor). :meth:`Session.result` turns it into a
:class:`Profile`: a table and a Chrome trace-event file (Perfetto, chrome://tracing).
"""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from .kernels import Launch
    from .ops import Node


class LaunchForms(Protocol):
    """A device's executor, as profiling reads it: the form it runs each recorded launch in."""

    def form(self, launch: Launch) -> Launch: ...


class ProfiledDevice(Protocol):
    """A batch's device, as profiling reads it: a :class:`~batchgpu.Device` (a layer above this module)."""

    kind: str

    @property
    def name(self) -> str: ...

    @property
    def executor(self) -> LaunchForms: ...


class RecordedView(Protocol):
    """What a batch recorded and last executed, as profiling reads it: a
    :class:`~batchgpu.runtime.BatchView` (a layer above this module)."""

    @property
    def nodes(self) -> tuple[Node, ...]: ...

    @property
    def record_spans(self) -> tuple[tuple[float, float], ...]: ...

    @property
    def profiled(self) -> Session | None: ...


class ProfiledBatch(Protocol):
    """A batch, as profiling reads it: a :class:`~batchgpu.GpuCommandBatch` (a layer above this module)."""

    name: str

    @property
    def device(self) -> ProfiledDevice: ...

    @property
    def released(self) -> bool: ...

    def view(self) -> RecordedView: ...

    def profile(self) -> Profile: ...


_profile_all = False
_profiled_batches: list[ProfiledBatch] = []


def profile_all(enabled: bool = True) -> None:
    """Profile every ``execute()`` of every batch from now on (``python -m batchgpu profile``)."""
    global _profile_all
    _profile_all = enabled
    if enabled:
        _profiled_batches.clear()


def profiled_batches() -> list[ProfiledBatch]:
    """Batches executed with profiling since :func:`profile_all` was turned on, in first-execute order."""
    return list(_profiled_batches)


def start(batch: ProfiledBatch, requested: bool) -> Session | None:
    """A session for one execute of ``batch`` when profiling was requested (or is on globally)."""
    if not (requested or _profile_all):
        return None
    if _profile_all and not any(b is batch for b in _profiled_batches):
        _profiled_batches.append(batch)
    return Session(batch)


def run_kwargs(executor: Any, session: Session | None) -> dict[str, Any]:
    """Keyword arguments for ``executor.run``: the session when profiling and the executor takes one;
    an executor without profiling support runs unprofiled and the profile says so."""
    if session is None:
        return {}
    kind = type(executor)
    supported = _supports_profile.get(kind)
    if supported is None:
        supported = _supports_profile[kind] = "profile" in inspect.signature(executor.run).parameters
    if not supported:
        session.message = f"the {executor.kind} executor does not support profiling: host time of the execute only"
        return {}
    return {"profile": session}


_supports_profile: dict[type, bool] = {}


def kernel_name(launch: Launch) -> str:
    return launch.kernel.name if launch.kernel is not None else f"{launch.family}.{launch.entry}"


def _grid(groups: int | Sequence[int]) -> tuple[int, int, int]:
    if isinstance(groups, (int, np.integer)):
        return (int(groups), 1, 1)
    padded = (*tuple(int(g) for g in groups), 1, 1)
    return (padded[0], padded[1], padded[2])


class Session:
    """What one profiled execute measured; executors fill in the device side."""

    def __init__(self, batch: ProfiledBatch) -> None:
        self.started = time.perf_counter()
        self.batch_name = batch.name
        self.device = batch.device.name
        self.executor = batch.device.kind
        view = batch.view()
        self.recorded: list[Node] = list(view.nodes)
        self.nodes: list[Node] = self.recorded  # the nodes the plan runs (fused chains), set by execute
        self.record_spans: list[tuple[float, float]] = list(view.record_spans)
        self.host: list[tuple[str, float, float]] = []  # (name, start s, end s) inside the execute
        self.finished: float | None = None
        # set by executors
        self.dispatch_grids: list[tuple[int, int, int]] | None = None  # actual grids, one per launch
        self.form = batch.device.executor.form  # the shape of each launch the executor runs
        self.gpu_fetch: Callable[[], np.ndarray | None] | None = None  # -> (dispatches, 2) ns, or (1, 2) for a pass
        self.gpu_pass_only = False  # the GPU times cover the whole compute pass, not each dispatch
        self.gpu_anchor: float | None = None  # host time the GPU track starts at (end of submit)
        self.op_host: dict[int, tuple[float, float]] = {}  # node index -> host (start, end) (reference executor)
        self.message = ""
        self._profile: Profile | None = None

    def span(self, name: str, started: float, ended: float | None = None) -> float:
        """Note a host span; returns its end (the start of the next)."""
        ended = time.perf_counter() if ended is None else ended
        self.host.append((name, started, ended))
        return ended

    def finish(self) -> None:
        self.finished = time.perf_counter()

    def settle(self) -> None:
        """Build the profile now (waits for the GPU), before the execution's readback is recycled."""
        self.result()

    def result(self) -> Profile:
        if self._profile is None:
            gpu = None
            if self.gpu_fetch is not None:
                try:
                    gpu = self.gpu_fetch()
                except Exception as exc:  # e.g. an async read of it in flight: try again later, never break the batch
                    return Profile.build(self, None, f"GPU timestamps could not be read (yet): {exc}")
                self.gpu_fetch = None
            self._profile = Profile.build(self, gpu)
        return self._profile


@dataclass
class ProfileRow:
    """One dispatch (one launch of an op; multi-pass ops have several rows with the same ``index``)."""

    index: int  # the op's position in the batch
    op: str
    kernel: str
    shape: str  # input shapes -> output shape
    dispatch: tuple[int, int, int]  # workgroups
    gpu_us: float | None = None
    host_us: float | None = None  # reference executor: numpy time of the op
    share: float | None = None  # of the total GPU (or host op) time

    def as_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "op": self.op,
            "kernel": self.kernel,
            "shape": self.shape,
            "dispatch": list(self.dispatch),
            "gpu_us": self.gpu_us,
            "host_us": self.host_us,
            "share": self.share,
        }


def _shape_text(node: Node) -> str:
    def fmt(shape: tuple[int, ...]) -> str:
        return "x".join(str(s) for s in shape) if shape else "()"

    inputs = ", ".join(fmt(t.shape) for t in node.inputs)
    if node.outputs:
        return f"{inputs} -> {', '.join(fmt(t.shape) for t in node.outputs)}"
    return f"{inputs} (in place)"


@dataclass
class Profile:
    """Timing of one execute: ``rows`` (one per dispatch), host spans, and the GPU spans."""

    batch: str
    device: str
    executor: str
    rows: list[ProfileRow]
    gpu_timing: bool  # per-dispatch GPU times are available
    message: str
    record_spans: list[tuple[str, float, float]]  # (op, start s, end s)
    host_spans: list[tuple[str, float, float]]  # plan / upload / encode / submit
    execute_span: tuple[float, float]
    gpu_spans: list[tuple[int, float, float]] = field(default_factory=list)  # (row, start s, end s), host clock
    pass_span: tuple[float, float] | None = None  # the whole compute pass on the GPU, host clock
    op_host_spans: list[tuple[int, float, float]] = field(default_factory=list)  # (row, start s, end s): reference

    @classmethod
    def build(cls, session: Session, gpu: np.ndarray | None, message: str = "") -> Profile:
        rows: list[ProfileRow] = []
        for index, node in enumerate(session.nodes):
            for launch in node.launches:
                launch = session.form(launch)
                shape = _shape_text(node)
                rows.append(ProfileRow(index, node.spec.name, kernel_name(launch), shape, _grid(launch.groups)))
        if session.dispatch_grids is not None:
            for row, grid in zip(rows, session.dispatch_grids):
                row.dispatch = grid
        message = message or session.message
        gpu_spans: list[tuple[int, float, float]] = []
        pass_span = None
        anchor = session.gpu_anchor if session.gpu_anchor is not None else (session.finished or session.started)
        if gpu is not None and len(gpu):
            ticks = np.asarray(gpu, dtype=np.float64)
            origin = float(ticks.min())
            if session.gpu_pass_only:
                pass_span = (anchor, anchor + (ticks[0, 1] - ticks[0, 0]) * 1e-9)
            else:
                for i, (row, (begin, end)) in enumerate(zip(rows, ticks)):
                    row.gpu_us = max(0.0, (end - begin) * 1e-3)
                    gpu_spans.append((i, anchor + (begin - origin) * 1e-9, anchor + (end - origin) * 1e-9))
                pass_span = (min(s for _, s, _ in gpu_spans), max(e for _, _, e in gpu_spans)) if gpu_spans else None
        host_spans: list[tuple[int, float, float]] = []
        for i, row in enumerate(rows):
            span = session.op_host.get(row.index)
            if span is not None and (i == 0 or rows[i - 1].index != row.index):  # an op's time on its first row
                row.host_us = (span[1] - span[0]) * 1e6
                host_spans.append((i, *span))
        timed = [r.gpu_us if r.gpu_us is not None else r.host_us for r in rows]
        total = sum(t for t in timed if t is not None)
        if total > 0:
            for row, t in zip(rows, timed):
                row.share = None if t is None else t / total
        record_spans = [(n.spec.name, start, end) for n, (start, end) in zip(session.recorded, session.record_spans)]
        finished = session.finished or time.perf_counter()
        return cls(
            batch=session.batch_name,
            device=session.device,
            executor=session.executor,
            rows=rows,
            gpu_timing=bool(gpu_spans),
            message=message,
            record_spans=record_spans,
            host_spans=list(session.host),
            execute_span=(session.started, finished),
            gpu_spans=gpu_spans,
            pass_span=pass_span,
            op_host_spans=host_spans,
        )

    # summaries --------------------------------------------------------------------------------

    @property
    def total_gpu_us(self) -> float | None:
        """Sum of the per-dispatch GPU times (or the whole pass when only that was measured)."""
        if self.gpu_timing:
            return sum(r.gpu_us or 0.0 for r in self.rows)
        if self.pass_span is not None:
            return (self.pass_span[1] - self.pass_span[0]) * 1e6
        return None

    def host_summary(self) -> dict[str, float]:
        """Host milliseconds: record (sum of the op calls), then each execute phase."""
        summary = {"record": 1e3 * sum(end - start for _, start, end in self.record_spans)}
        for name, start, end in self.host_spans:
            summary[name] = summary.get(name, 0.0) + 1e3 * (end - start)
        summary["execute"] = 1e3 * (self.execute_span[1] - self.execute_span[0])
        return summary

    def table(self, limit: int | None = None) -> str:
        """A Markdown table: op, kernel, shape, dispatch size, GPU µs (or host µs), share of total."""
        host_column = not self.gpu_timing and any(r.host_us is not None for r in self.rows)
        time_header = "host us" if host_column else "GPU us"
        title = f"profile of batch {self.batch!r} on {self.device} ({self.executor})"
        lines = [title]
        if self.message:
            lines.append(f"note: {self.message}")
        rows = self.rows if limit is None else sorted(self.rows, key=lambda r: -(r.gpu_us or r.host_us or 0))[:limit]
        cells = []
        for r in rows:
            t = r.host_us if host_column else r.gpu_us
            cells.append(
                [
                    str(r.index),
                    r.op,
                    r.kernel,
                    r.shape,
                    "x".join(str(g) for g in r.dispatch),
                    "-" if t is None else f"{t:.1f}",
                    "-" if r.share is None else f"{100 * r.share:.1f}%",
                ]
            )
        lines += markdown_table(["#", "op", "kernel", "shape", "dispatch", time_header, "share"], cells, "r<<<<rr")
        if limit is not None and len(self.rows) > limit:
            lines.append(f"({len(self.rows) - limit} more dispatches not shown)")
        total = self.total_gpu_us
        host = self.host_summary()
        totals = [f"{len(self.rows)} dispatches"]
        if total is not None:
            totals.append(f"GPU total {total:.1f} us" + (" (whole compute pass)" if not self.gpu_timing else ""))
        elif host_column:
            totals.append(f"op host total {sum(r.host_us or 0 for r in self.rows):.1f} us")
        totals.append("host ms: " + ", ".join(f"{name} {ms:.2f}" for name, ms in host.items()))
        lines.append("; ".join(totals))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    # trace ------------------------------------------------------------------------------------

    def trace_events(self, pid: int = 1, origin: float | None = None) -> list[dict[str, Any]]:
        """Chrome trace events: tid 1 = host (record calls, execute phases), tid 2 = device ops."""
        starts = [s for _, s, _ in self.record_spans] + [self.execute_span[0]]
        origin = min(starts) if origin is None else origin

        def us(t: float) -> float:
            return round((t - origin) * 1e6, 3)

        def event(name: str, cat: str, tid: int, start: float, end: float, **args: Any) -> dict[str, Any]:
            return {
                "name": name,
                "cat": cat,
                "ph": "X",
                "pid": pid,
                "tid": tid,
                "ts": us(start),
                "dur": max(0.0, round((end - start) * 1e6, 3)),
                "args": args,
            }

        device_track = "GPU ops" if self.executor != "reference" else "ops (numpy reference, host time)"
        events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": f"batchgpu {self.batch}"}},
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": 1, "args": {"name": "host: record / encode"}},
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": 2, "args": {"name": device_track}},
            {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": 1, "args": {"sort_index": 1}},
            {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": 2, "args": {"sort_index": 2}},
        ]
        if self.record_spans:
            first, last = self.record_spans[0][1], self.record_spans[-1][2]
            events.append(event("record", "record", 1, first, last, ops=len(self.record_spans)))
            for index, (op, start, end) in enumerate(self.record_spans):
                events.append(event(op, "record", 1, start, end, index=index))
        events.append(event("execute", "execute", 1, *self.execute_span))
        for name, start, end in self.host_spans:
            events.append(event(name, "execute", 1, start, end))
        if self.gpu_spans:
            first, last = self.pass_span or (self.gpu_spans[0][1], self.gpu_spans[-1][2])
            events.append(event("compute pass", "gpu", 2, first, last, dispatches=len(self.gpu_spans)))
            for row_index, start, end in self.gpu_spans:
                row = self.rows[row_index]
                events.append(
                    event(
                        row.op,
                        "gpu",
                        2,
                        start,
                        end,
                        index=row.index,
                        kernel=row.kernel,
                        shape=row.shape,
                        dispatch="x".join(map(str, row.dispatch)),
                        gpu_us=row.gpu_us,
                    )
                )
        elif self.pass_span is not None:
            events.append(event("compute pass", "gpu", 2, *self.pass_span, dispatches=len(self.rows)))
        for row_index, start, end in self.op_host_spans:  # reference executor: numpy ops on the host
            row = self.rows[row_index]
            events.append(event(row.op, "ops", 2, start, end, index=row.index, shape=row.shape, host_us=row.host_us))
        # sorted by start, parents (longer) before the children they contain
        events[5:] = sorted(events[5:], key=lambda e: (e["tid"], e["ts"], -e["dur"]))
        return events

    def trace(self) -> dict[str, Any]:
        return {
            "traceEvents": self.trace_events(),
            "displayTimeUnit": "ms",
            "otherData": {
                "batch": self.batch,
                "device": self.device,
                "executor": self.executor,
                "gpu_timing": self.gpu_timing,
                "note": self.message
                or "GPU timestamps are on the GPU's clock; the GPU track is placed to start at the end of submit",
            },
        }

    def save_trace(self, path: str | Path) -> Path:
        """Write the Chrome trace-event JSON (open it in https://ui.perfetto.dev or chrome://tracing)."""
        path = Path(path)
        path.write_text(json.dumps(self.trace(), indent=1) + "\n")
        return path


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str) -> list[str]:
    """Lines of a Markdown table with padded columns; ``align`` has one ``<`` or ``r`` per column."""
    widths = [max([len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        padded = [c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(cells, widths, align)]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join("-" * (w + 1) + ":" if a == "r" else "-" * (w + 2) for w, a in zip(widths, align)) + "|"
    return [line(header), rule, *(line(row) for row in rows)]


def save_traces(profiles: Sequence[Profile], path: str | Path) -> Path:
    """Several profiles in one trace file, one process row per batch, on one time axis."""
    starts = [min([s for _, s, _ in p.record_spans] + [p.execute_span[0]]) for p in profiles]
    origin = min(starts) if starts else 0.0
    events: list[dict[str, Any]] = []
    for pid, profile in enumerate(profiles, start=1):
        events += profile.trace_events(pid=pid, origin=origin)
    path = Path(path)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}, indent=1) + "\n")
    return path
