"""Which cards the GPU child is given and which of them it uses, from what Spillway knows of it:
`gpu.device` (left unset: every card of its build's vendors it can see, as llama-server alone),
its build's own listing (`--list-devices`), its args, its load log and its own memory on each
card. The rules are policy/devices.py's; this gathers their inputs, and gives the GPU child its
environment.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Sequence

from ..config import llama_args
from ..config.schema import ChildConfig
from ..policy.devices import (
    VISIBILITY, Card, ChildArgs, Listed, Selection, build_vendors, cuda_visible, devices_of_child,
    given_why, parse_using_device, pick, usable_by_build, visible,
)
from .sampler import GpuSample


def child_args(settings: ChildConfig) -> ChildArgs:
    args = settings.args
    return ChildArgs(device=llama_args.flag_value(args, "-dev"),
                     split_mode=llama_args.flag_value(args, "-sm"),
                     main_gpu=llama_args.flag_value(args, "-mg"),
                     tensor_split=llama_args.flag_value(args, "-ts"))


class Placement:
    """The GPU child's cards. The daemon feeds it the listing and the child's output lines,
    and the monitor asks it at every sample (`choose`)."""

    def __init__(self, settings: ChildConfig, pids: Callable[[], Iterable[int] | None],
                 listed: Callable[[], Sequence[Listed]] = lambda: ()) -> None:
        self.settings = settings
        self.pids = pids  # the GPU child's processes (a router's instances among them)
        self.listed = listed  # its build's --list-devices (the monitor keeps it)
        self.logged: list[Listed] = []  # `using device` lines of its current process
        self.missing = ""  # what gpu.device names that is not there

    def configure(self, settings: ChildConfig) -> None:
        """A reload: new args (gpu.device itself needs a restart: the keeper keeps it)."""
        self.settings = settings

    def on_line(self, line: str) -> None:
        found = parse_using_device(line)
        if found is not None:
            self.logged = [d for d in self.logged if d.pci_bus_id != found.pci_bus_id] + [found]

    def on_start(self) -> None:
        self.logged = []

    def candidates(self, cards: Sequence[Card]) -> list[Card]:
        """The cards it is given: those gpu.device picks (all of them when it is unset or
        "all") among the cards its build can use and its environment lets it see (the
        visible-devices variables of Spillway's own environment, or of gpu.env, which wins): an
        index counts the cards it sees."""
        seen = visible(usable_by_build(cards, self.listed()), self.visibility_env())
        chosen, self.missing = pick(seen, self.settings.device)
        return chosen

    def visibility_env(self) -> dict[str, str]:
        names = {var for var, _ in VISIBILITY}
        env = {k: v for k, v in os.environ.items() if k in names}
        env.update({k: v for k, v in self.settings.env.items() if k in names})
        return env

    def choose(self, samples: Sequence[GpuSample]) -> Selection:
        pids = list(self.pids() or ())
        holdings = {s.pci_bus_id: sum(s.process_bytes.get(p, 0) for p in pids)
                    for s in samples}
        cards = [s.card for s in samples]
        candidates = self.candidates(cards)
        if self.missing and not candidates:
            selection = Selection((), "none", f"gpu.device names {self.missing!r}: no such "
                                  f"card here (cards: {', '.join(c.pci_bus_id for c in cards)})")
        else:
            selection = devices_of_child(candidates, child_args(self.settings), self.logged,
                                         holdings)
        return dataclasses.replace(
            selection, given=tuple(c.pci_bus_id for c in candidates),
            given_why=given_why(self.settings.device, build_vendors(self.listed())))

    def env(self, samples: Sequence[GpuSample]) -> dict[str, str]:
        """The GPU child's environment: CUDA numbers cards as NVML and nvidia-smi do, and it
        sees the NVIDIA cards it is given, by UUID (policy/devices.cuda_visible). Other
        vendors' cards are not hidden by Spillway: their order is their runtime's (`-dev`
        picks)."""
        env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        given = self.candidates([s.card for s in samples])
        value = cuda_visible(given, self.settings.device, bool(samples),
                             self.visibility_env().get("CUDA_VISIBLE_DEVICES"))
        if value is not None:
            env["CUDA_VISIBLE_DEVICES"] = value
        return env
