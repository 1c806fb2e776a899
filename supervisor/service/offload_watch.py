"""How much of the GPU child is on the GPU, watched: its load log line by line, and once it is
ready (at the first GPU sample after) its own memory on its cards, judged by policy/offload.py
once per process. Fewer layers than asked is told (the status, the page, the log); under
`gpu.require_offload` it is a failed start: an incident record, and the child is ended, its exit
recorded as `no_offload` (a quick failure: see lifecycle.Ended.unfit), while the CPU child
serves. Single-model mode only: a router's instances hold its memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from ..config import llama_args
from ..config.schema import Config
from ..gpu import GpuMonitor
from ..policy import lifecycle, offload
from ..policy.evidence import FailureKind
from ..policy.lifecycle import ChildState
from ..records.incidents import IncidentLog, child_episode
from ..serving.resources import Resources
from ..upstreams.children import Child

_log = logging.getLogger("spillway.offload")


class OffloadWatch:
    def __init__(self, config: Callable[[], Config], children: Callable[[], Mapping[str, Child]],
                 monitor: GpuMonitor, res: Callable[[], Resources], incidents: IncidentLog,
                 owners: Callable[[], Mapping[str, list[int] | None]]) -> None:
        self.config = config
        self.children = children
        self.monitor = monitor
        self.res = res
        self.incidents = incidents
        self.owners = owners
        # Its process's load log, and the verdict, final once it is not unknown (per process:
        # its generation).
        self.log = offload.LoadLog()
        self.verdict = offload.pending("not judged yet: the GPU child has not started")
        self._judged: int | None = None

    def on_start(self) -> None:
        """A new process: its load log is read anew."""
        self.log.reset()
        self.verdict = offload.pending("not judged yet: the GPU child is loading")

    def on_line(self, line: str) -> None:
        had = self.log.no_gpu
        self.log.feed(line)
        if had is None and self.log.no_gpu is not None:
            self.judge()  # conclusive while it loads: judged (and ended) at once

    def judge(self) -> None:
        """How much of the GPU child is on the GPU (policy/offload.py), once per process: from
        its load log and, where the monitor has figures, a sample taken after it was ready;
        while it loads already when llama-server says it has no GPU at all (conclusive, and
        an end then is a quick failure that served nothing). Unknown is judged again at the
        next tick. Fewer layers than asked is told (status, log); under gpu.require_offload it
        is a failed start: an incident record, and the child is ended, its exit recorded as
        no_offload, and backs off (the CPU child serves meanwhile). Single model only: a
        router's instances hold its memory."""
        config = self.config()
        gpu = self.children()[config.gpu_child]
        early = gpu.state is ChildState.STARTING and self.log.no_gpu is not None
        ready = gpu.state is ChildState.READY and gpu.ready_at is not None
        if config.router or gpu.pid is None or not (early or ready) or \
                self._judged == gpu.generation:
            return
        sampled = self.monitor.sampled_at()
        if not early and self.monitor.available and gpu.ready_at is not None and \
                (sampled is None or sampled < gpu.ready_at):
            return
        args = gpu.cfg.args
        wanted = offload.asked(
            llama_args.flag_value(args, "-ngl") or gpu.cfg.env.get("LLAMA_ARG_N_GPU_LAYERS"),
            llama_args.flag_value(args, "-fit"), llama_args.flag_value(args, "-dev"),
            overrides=any(llama_args.find_flag(args, f) is not None
                          for f in ("-ot", "-cmoe", "-ncmoe")))
        cards = self.monitor.child_devices
        ours = {pid for pids in self.owners().values() for pid in pids or ()}
        figures = any(s.process_bytes for s in cards)
        memory = offload.Memory(
            sum(s.process_bytes.get(gpu.pid, 0) for s in cards) if figures else None,
            self.res().model_size or None,
            max((b for s in cards for p, b in s.process_bytes.items() if p not in ours),
                default=0))
        shape = self.res().model_shape
        self.verdict = verdict = offload.judge(self.log, wanted, memory,
                                               shape.n_layer if shape is not None else None)
        if verdict.state == offload.UNKNOWN:
            return
        self._judged = gpu.generation
        if not verdict.short or verdict.kind is None:
            _log.info("[%s] offload: %s: %s", gpu.name, verdict.state, verdict.why)
            return
        if not config.gpu_settings.require_offload:
            _log.warning("[%s] not on the GPU as asked: %s (told only: gpu.require_offload is "
                        "false)", gpu.name, verdict.why)
            return
        _log.warning("[%s] not on the GPU as asked: %s; gpu.require_offload: ending it as a "
                    "failed start", gpu.name, verdict.why)
        # An episode of the child's with no request in it: the record says what was done.
        self.incidents.write(child_episode(
            gpu.name, verdict.kind, "ended", "gpu.require_offload: a failed start; it backs off "
            "and the CPU child serves", evidence=verdict.why))
        gpu.engine.post(lifecycle.Unresponsive(
            gpu.generation, f"not on the GPU as asked: {verdict.why} (gpu.require_offload)",
            kind=FailureKind.NO_OFFLOAD))

    def to_json(self) -> dict[str, Any] | None:
        """The GPU child's offload, for its status; None in router mode."""
        return None if self.config().router else self.verdict.to_json()
