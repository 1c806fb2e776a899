"""Which cards the GPU child uses, from what Spillway knows of it: `gpu.device`, its build's own
listing (`--list-devices`), its args, its load log and its own memory on each card. The rule is
policy/devices.py's; this gathers its inputs, and gives the GPU child its environment.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence

from ..config import llama_args
from ..config.schema import ChildConfig
from ..policy.devices import (
    NVIDIA, VISIBILITY, Card, ChildArgs, Listed, Selection, devices_of_child, parse_using_device,
    pick, usable_by_build, visible,
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
        """The cards gpu.device picks among those its build can use and its environment lets
        it see (the visible-devices variables of Spillway's own environment, or of gpu.env,
        which wins): an index counts the cards it sees."""
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
            return Selection((), "none", f"gpu.device names {self.missing!r}: no such card "
                             f"here (cards: {', '.join(c.pci_bus_id for c in cards)})")
        return devices_of_child(candidates, child_args(self.settings), self.logged, holdings)

    def env(self, samples: Sequence[GpuSample]) -> dict[str, str]:
        """The GPU child's environment: CUDA numbers cards as NVML and nvidia-smi do, and
        when gpu.device names NVIDIA cards it sees those alone (by UUID). Other vendors'
        cards are not hidden by Spillway: their order is their runtime's (`-dev` picks)."""
        env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        device = self.settings.device
        chosen = self.candidates([s.card for s in samples])
        uuids = [c.uuid for c in chosen if c.vendor == NVIDIA and c.uuid]
        if device is not None and device.strip().lower() not in ("", "all") and uuids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(uuids)
        elif not samples and device is not None and device.strip().isdigit():
            env["CUDA_VISIBLE_DEVICES"] = device.strip()  # no figures: the index as given
        return env
