"""What Spillway tells a load balancer in front of several machines: HAProxy's agent-check reply.

Pure. HAProxy connects to the agent port on its interval and reads one line of words
(HAProxy's "agent-check"): a weight (`80%`) scales the server's configured weight, `ready`
lifts a drain (`up` alone does not), `drain` keeps the server's connections but sends it no new
ones, `up` and `down` set its operational state, and `#text` after `down` is shown as the
reason. So:

- the GPU child serves: `up ready N%`, N the share of the GPU's slots that are free (at least
  1%, so a full machine still gets the requests the others cannot take);
- the GPU child is not serving (paused, draining, restarting, FATAL) but the CPU child is:
  `up drain`, so new work goes to machines whose GPU is up. HAProxy sends a drained server
  nothing new at all, so when every machine is draining its CPU children serve through
  `backup` lines without the agent (examples/haproxy.cfg);
- no child can serve: `down #why`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MachineHealth:
    gpu_serving: bool  # the GPU child (router mode: the GPU router) is READY
    cpu_serving: bool  # the CPU child is READY, or can be started on demand
    gpu_slots: int  # admission caps on the GPU side (router mode: over its loaded models)
    gpu_busy: int
    why_not: str = ""  # when nothing serves: what the status says


def agent_reply(h: MachineHealth) -> str:
    """The line, without its newline."""
    if h.gpu_serving:
        free = 1.0 if h.gpu_slots <= 0 else max(0, h.gpu_slots - h.gpu_busy) / h.gpu_slots
        return f"up ready {max(1, round(100 * free))}%"
    if h.cpu_serving:
        return "up drain"
    why = " ".join(h.why_not.split())[:200] or "no child can serve"
    return f"down #{why}"
