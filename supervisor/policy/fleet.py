"""The rules that span several children, pure: what the fleet's parts (service/fleet.py, the one
owner of the children; the small tier, the tick, the single-model mode) decide from states and
figures, and carry out by asking the fleet.

- the on-demand small child (small.mode = "on-demand") starts into the memory a GPU child's
  death freed, while the GPU child waits for its next try; it holds the GPU child's start while
  it holds (or will hold) VRAM, and is drained and stopped first;
- a FATAL GPU child is tried again at once once another process freed the card's memory and
  the card has room for it;
- an on-demand child idle for its idle_stop_s is stopped;
- the GPU child idle for gpu.idle_release_s is stopped, its VRAM lent back to the card, while
  the CPU child answers.
"""

from __future__ import annotations

from .lifecycle import DEAD, ChildState

# The GPU child waiting for its next try after a death (BACKOFF, FATAL): the small child
# serves meanwhile. Not EXITED alone, which may walk on to STOPPED (a stop asked for as it died).
GPU_WAITING = DEAD - {ChildState.EXITED}
# The small child's states in which it holds VRAM, or will (its own back-off restarts it).
SMALL_UP = frozenset({ChildState.STARTING, ChildState.READY, ChildState.DRAINING,
                      ChildState.STOPPING, ChildState.BACKOFF, ChildState.EXITED})


def small_starts(gpu_old: ChildState, gpu_new: ChildState, small: ChildState,
                 paused: bool) -> bool:
    """The on-demand small child starts: the GPU child has just begun to wait for its next
    try after a death, the small child is stopped, and neither is paused."""
    return (gpu_new in GPU_WAITING and gpu_old not in GPU_WAITING
            and small is ChildState.STOPPED and not paused)


def small_holds_gpu(small: ChildState) -> bool:
    """The on-demand small child holds the GPU child's start: it holds VRAM, or will."""
    return small in SMALL_UP


def gpu_back_after_fatal(free_bytes: int, free_at_fatal_bytes: int | None, slack_bytes: int,
                         short: bool) -> bool:
    """A FATAL GPU child is tried again now: the card has room for it (`short`: the
    resources' shortage says it has not), and another process freed at least `slack_bytes`
    since it went FATAL (unknown then: room is enough). Both are needed: free memory alone, if
    the estimate of its need is low, would restart it on every tick into the same failure."""
    freed = None if free_at_fatal_bytes is None else free_bytes - free_at_fatal_bytes
    return not short and (freed is None or freed >= slack_bytes)


def idle_stop(on_demand: bool, state: ChildState, in_flight: int, idle_s: float,
              idle_stop_s: float) -> bool:
    """An on-demand child, READY with nothing in flight for its idle_stop_s, is stopped."""
    return (on_demand and state is ChildState.READY and in_flight == 0
            and idle_s >= idle_stop_s)


def idle_release(release_s: float, gpu: ChildState, in_flight: int, idle_s: float,
                 cpu: ChildState, lent: bool) -> bool:
    """The GPU child is lent back to the card (gpu.idle_release_s; 0: never): READY with
    nothing in flight for release_s, not lent already, and the CPU child READY to answer
    meanwhile. Without a CPU child serving, the next request would wait for a whole model
    load, which is what a timer alone does (llama-swap's ttl, Ollama's keep_alive)."""
    return (release_s > 0 and gpu is ChildState.READY and in_flight == 0
            and idle_s >= release_s and cpu is ChildState.READY and not lent)
