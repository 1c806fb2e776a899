"""Which GPUs a child uses, how much room each has, and what a child must not see.

Pure: the caller reads the cards (NVML, amdgpu's sysfs, the kernel's DRM fdinfo), the child's
args and environment, its load log and its own memory per card, and this module decides.

A card is always named by its PCI address, never by an index: CUDA (FASTEST_FIRST unless
CUDA_DEVICE_ORDER says otherwise), ROCm, Vulkan, SYCL and NVML each number the cards their own
way. The address is written as the kernel writes it, `0000:03:00.0` (NVML's `00000000:03:00.0`
and CUDA's upper case come to the same).

What the GPU child uses, most certain first (`devices_of_child`):
1. its load log: llama.cpp names each device it loads on, with its address, at `-lv 4`
   (`llama_model_load_from_file_impl: using device ROCm0 (AMD Radeon RX 7900 XTX)
   (0000:03:00.0) - 24000 MiB free`);
2. the cards where its process holds memory (NVML's per-process list, fdinfo's `drm-pdev`),
   leaving out a card where it holds no more than a context's worth while it holds much more
   on another (a CUDA process opens a context on every card it sees: llama.cpp#20595);
3. before either is known: the cards it is given (`given`), narrowed by its `-dev`, `-sm none`
   with `-mg`, and the zeros of `-ts`. An index there is trusted only where the order is known
   (CUDA under CUDA_DEVICE_ORDER=PCI_BUS_ID, which Spillway sets, or one card of that vendor);
   otherwise every such card counts, and the selection says so.

The cards it is given: those `gpu.device` names among the cards of its build's vendors that it
can see; `gpu.device` left unset gives it every one of them, as llama-server alone uses every
card it sees (a `-ts 1,1` split over two cards then works as on the command line).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

MIB = 1024 * 1024
GIB = 1024 * MIB

NVIDIA, AMD, INTEL, APPLE = "nvidia", "amd", "intel", "apple"
PCI_VENDORS = {"0x10de": NVIDIA, "0x1002": AMD, "0x8086": INTEL}

# llama.cpp's backend names -> the vendor whose cards they number (Vulkan numbers anyone's).
_BACKEND_VENDOR = {"cuda": NVIDIA, "rocm": AMD, "hip": AMD, "sycl": INTEL, "metal": APPLE}

# A card where a process holds no more than this, while it holds far more on another, holds a
# context and nothing of the model (100-555 MiB per card in llama.cpp#20595).
CONTEXT_ONLY_BYTES = 640 * MIB

# Ollama's rule for an AMD APU (discover/amd_linux.go): a small carve-out of VRAM and a GTT
# window at least four times larger means the model lives in GTT, so the usable pool counts it.
APU_MAX_VRAM_BYTES = 4 * GIB
APU_GTT_FACTOR = 4

# Every vendor's way of hiding its cards from a process (the CPU child must open none: even a
# context costs memory on every card it sees).
HIDE_ALL_GPUS = {
    "CUDA_VISIBLE_DEVICES": "",
    "HIP_VISIBLE_DEVICES": "-1",
    "ROCR_VISIBLE_DEVICES": "-1",
    "GGML_VK_VISIBLE_DEVICES": "",  # ggml-vulkan: an empty list of indices is no device
    "ONEAPI_DEVICE_SELECTOR": "!*:gpu",  # oneAPI: every device but the GPUs
}

_PCI = re.compile(r"(?i)\b([0-9a-f]{4,8}):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])\b")
_PCI_SHORT = re.compile(r"(?i)^([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])$")
# `  ROCm0: AMD Radeon(TM) Graphics (110511 MiB, 110357 MiB free)` (--list-devices)
_LISTED = re.compile(r"^\s*([A-Za-z]+)(\d+):\s*(.*?)\s*\((\d+) MiB, (\d+) MiB free\)\s*$")
# `using device CUDA0 (NVIDIA H200) (0000:01:00.0) - 142000 MiB free` (the load log, -lv 4)
_USING = re.compile(r"using device ([A-Za-z]+)(\d+) \((.*)\) \(([^()]*)\) - (\d+) MiB free")


def normalize_pci(text: str) -> str | None:
    """`00000000:01:00.0`, `0000:01:00.0`, `01:00.0` -> `0000:01:00.0`; None if none."""
    text = text.strip()
    m = _PCI.search(text)
    if m:
        return f"{int(m.group(1), 16):04x}:{m.group(2)}:{m.group(3)}.{m.group(4)}".lower()
    m = _PCI_SHORT.match(text)
    if m:
        return f"0000:{m.group(1)}:{m.group(2)}.{m.group(3)}".lower()
    return None


def is_apu(vram_total: int, gtt_total: int) -> bool:
    """An AMD APU whose models live in GTT (Ollama's rule)."""
    return 0 < vram_total <= APU_MAX_VRAM_BYTES and gtt_total >= APU_GTT_FACTOR * vram_total


@dataclass(frozen=True)
class Card:
    """One GPU of the machine, as the samplers found it."""

    vendor: str
    pci_bus_id: str
    uuid: str = ""
    name: str = ""


@dataclass(frozen=True)
class Listed:
    """One device as llama-server lists it (`--list-devices`) or names it at load."""

    backend: str  # "CUDA", "ROCm", "Vulkan", "SYCL", "Metal"
    index: int  # the backend's own number
    description: str
    total_mib: int | None = None
    free_mib: int | None = None
    pci_bus_id: str | None = None  # the load log's; --list-devices does not say

    @property
    def name(self) -> str:
        return f"{self.backend}{self.index}"

    @property
    def vendor(self) -> str | None:
        """The vendor of the card, from the backend, or for Vulkan from its description."""
        known = _BACKEND_VENDOR.get(self.backend.lower())
        return known if known is not None else vendor_of_name(self.description)


def vendor_of_name(description: str) -> str | None:
    low = description.lower()
    for word, vendor in (("nvidia", NVIDIA), ("geforce", NVIDIA), ("amd", AMD),
                         ("radeon", AMD), ("intel", INTEL), ("arc", INTEL), ("apple", APPLE)):
        if re.search(rf"\b{word}\b", low):
            return vendor
    return None


def parse_listing(lines: Iterable[str]) -> list[Listed]:
    """The devices of `llama-server --list-devices` (or lines of the same shape)."""
    out = []
    for line in lines:
        m = _LISTED.match(line)
        if m:
            out.append(Listed(m.group(1), int(m.group(2)), m.group(3), int(m.group(4)),
                              int(m.group(5))))
    return out


def parse_using_device(line: str) -> Listed | None:
    """A load log's `using device NAME (DESCRIPTION) (PCI) - N MiB free` line, or None."""
    m = _USING.search(line)
    if m is None:
        return None
    return Listed(m.group(1), int(m.group(2)), m.group(3), None, int(m.group(5)),
                  normalize_pci(m.group(4)))


@dataclass(frozen=True)
class ChildArgs:
    """The flags of a llama-server that say where its layers go (the values as written)."""

    device: str | None = None  # -dev: "CUDA0,CUDA1", "none"
    split_mode: str | None = None  # -sm: "none", "layer", "row", "tensor"
    main_gpu: str | None = None  # -mg
    tensor_split: str | None = None  # -ts: "3,1" or "3/1"

    def ratios(self) -> list[float] | None:
        if not self.tensor_split:
            return None
        try:
            return [float(x) for x in re.split(r"[,/]", self.tensor_split) if x.strip()]
        except ValueError:
            return None

    def said(self) -> str:
        """The flags that place the layers, as a command line writes them: `-sm none -mg 1`."""
        flags = (("-dev", self.device), ("-sm", self.split_mode), ("-mg", self.main_gpu),
                 ("-ts", self.tensor_split))
        return " ".join(f"{flag} {value}" for flag, value in flags if value is not None)

    def splits_across(self) -> int:
        """How many devices the args name for the layers (0: they do not say)."""
        if self.split_mode is not None and self.split_mode.strip() == "none":
            return 1
        names = _device_names(self.device)
        if names:
            return len(names)
        ratios = self.ratios()
        return sum(1 for r in ratios if r > 0) if ratios else 0


def _device_names(device: str | None) -> list[str]:
    if not device or device.strip() in ("none", "auto"):
        return []
    return [d.strip() for d in device.split(",") if d.strip()]


@dataclass(frozen=True)
class Selection:
    """The cards a child uses, by PCI address, and how that is known."""

    pci_bus_ids: tuple[str, ...]
    how: str  # "load log", "its own memory", "config", "config (assumed)", "none"
    why: str = ""  # for people: what decided it, and what is assumed
    shares: Mapping[str, float] | None = None  # -ts ratios by address; None: by free memory
    # The cards it was given to use (`given`), by address, and why those (`given_why`); None
    # where the chooser does not say (a test's, or before the daemon knows the child).
    given: tuple[str, ...] | None = None
    given_why: str = ""

    @property
    def exact(self) -> bool:
        return self.how in ("load log", "its own memory", "config", "none")


def pick(cards: Sequence[Card], device: str | None) -> tuple[list[Card], str]:
    """The cards `gpu.device` names among `cards` (in PCI order): "all", an index, a PCI
    address, a UUID, or a comma-separated list of them; and what could not be found."""
    if device is None or device.strip().lower() in ("", "all"):
        return list(cards), ""
    chosen: list[Card] = []
    missing = []
    for token in (t.strip() for t in device.split(",") if t.strip()):
        card = _find(cards, token)
        if card is None:
            missing.append(token)
        elif card not in chosen:
            chosen.append(card)
    return chosen, ", ".join(missing)


def _find(cards: Sequence[Card], token: str) -> Card | None:
    if token.isdigit():
        i = int(token)
        return cards[i] if i < len(cards) else None
    pci = normalize_pci(token)
    for card in cards:
        if pci is not None and card.pci_bus_id == pci:
            return card
        if card.uuid and card.uuid.lower() == token.lower():
            return card
    return None


def build_vendors(listed: Sequence[Listed]) -> set[str]:
    """The vendors whose cards the build lists (empty: it lists none, or none Spillway knows)."""
    return {v for v in (d.vendor for d in listed) if v is not None}


def usable_by_build(cards: Sequence[Card], listed: Sequence[Listed]) -> list[Card]:
    """The cards of the vendors the build lists devices of; all of them when it lists none
    or its listing names no vendor Spillway knows (the figures still say something)."""
    vendors = build_vendors(listed)
    if not vendors:
        return list(cards)
    return [c for c in cards if c.vendor in vendors]


def names_cards(device: str | None) -> bool:
    """Whether gpu.device names cards (an index, an address, a UUID, a list of them), rather
    than being left unset (None) or "all"."""
    return device is not None and device.strip().lower() not in ("", "all")


_VENDOR_NAMES = {NVIDIA: "NVIDIA", AMD: "AMD", INTEL: "Intel", APPLE: "Apple"}


def given_why(device: str | None, vendors: Iterable[str]) -> str:
    """Why the GPU child is given the cards it is, for people (the status says it)."""
    names = "/".join(_VENDOR_NAMES.get(v, v) for v in sorted(vendors))
    every = f"every {names} card it can see" if names else "every card it can see"
    if device is None:
        return f"gpu.device is not set: {every}, as llama-server alone uses them"
    if not names_cards(device):  # "all" (or "", which means the same)
        return f'gpu.device = "{device.strip()}": {every}'
    return f'gpu.device = "{device.strip()}"'


def cuda_visible(given: Sequence[Card], device: str | None, sampled: bool,
                 own: str | None) -> str | None:
    """The GPU child's CUDA_VISIBLE_DEVICES, or None to leave what its environment has.

    `given`: the cards it is given, in gpu.device's order (PCI order when it names none);
    `sampled`: whether the cards were found (without figures there are no UUIDs); `own`: a
    CUDA_VISIBLE_DEVICES of Spillway's environment or of gpu.env.
    - gpu.device names cards: the NVIDIA ones among them, by UUID, in its order (CUDA0 is the
      first named); without figures an index, or a list of them, as given.
    - gpu.device unset: every NVIDIA card it is given, by UUID in PCI order. Under
      CUDA_DEVICE_ORDER=PCI_BUS_ID that is the numbering CUDA gives them anyway, so its own
      `-dev CUDA1`, `-mg`, `-ts` mean what they meant on the command line; a single card is
      named as it was when gpu.device defaulted to 0. A CUDA_VISIBLE_DEVICES of the user's own
      already says which cards, in the user's order: it is kept as it is.
    - "all": nothing set, as llama-server alone.
    """
    uuids = [c.uuid for c in given if c.vendor == NVIDIA and c.uuid]
    if device is None:
        return ",".join(uuids) if uuids and own is None else None
    if not names_cards(device):
        return None
    if uuids:
        return ",".join(uuids)
    indices = [t.strip() for t in device.split(",")]
    if not sampled and all(t.isdigit() for t in indices):
        return ",".join(indices)  # no figures: the indices as given
    return None


def devices_of_child(candidates: Sequence[Card], args: ChildArgs,
                     logged: Sequence[Listed] = (),
                     holdings: Mapping[str, int] | None = None) -> Selection:
    """The cards a GPU child uses (see the module's note for the order of the evidence).
    `candidates`: the cards it may use (gpu.device among those its build can use), in PCI
    order; `holdings`: its own bytes on each card, by address (empty before it runs)."""
    known = {c.pci_bus_id for c in candidates}
    ratios = args.ratios()
    from_log = [d.pci_bus_id for d in logged if d.pci_bus_id]
    if from_log:
        ids = tuple(dict.fromkeys(from_log))
        return Selection(ids, "load log", "named by its load log",
                         _shares(ids, ratios))
    held = {pci: n for pci, n in (holdings or {}).items() if n > 0 and pci in known}
    if held:
        most = max(held.values())
        ids = tuple(pci for pci in sorted(held)
                    if held[pci] > CONTEXT_ONLY_BYTES or held[pci] * 8 >= most)
        return Selection(ids, "its own memory", "where its process holds memory",
                         _shares(ids, ratios))
    if _device_names(args.device) == [] and args.device is not None and \
            args.device.strip() == "none":
        return Selection((), "none", "--device none: it uses no GPU")
    return _from_args(candidates, args, ratios)


def _from_args(candidates: Sequence[Card], args: ChildArgs,
               ratios: list[float] | None) -> Selection:
    """Before it runs: the candidates narrowed by the args where the numbering is known."""
    slots = _slots(args.device)
    chosen, assumed = (_by_names(candidates, slots, args, ratios) if slots
                       else _by_position(candidates, args, ratios))
    ids = tuple(c.pci_bus_id for c in chosen)
    if not ids:
        return Selection((), "none", "no card it can use")
    if assumed:
        return Selection(ids, "config (assumed)",
                         "the backend numbers its devices in its own order, so every card it "
                         "may use counts (at -lv 4 its load log names them exactly)")
    why = ("every card it is given" if len(ids) == len(candidates) else
           f"the cards it is given that its {args.said()} leaves it")
    return Selection(ids, "config", why,
                     _shares(ids, ratios) if len(ids) == len(slots or candidates) else None)


def _slots(device: str | None) -> list[tuple[str, int]]:
    """-dev's names as (backend, index): `CUDA0,ROCm1` -> [("CUDA", 0), ("ROCm", 1)]."""
    out = []
    for name in _device_names(device):
        m = re.match(r"^([A-Za-z]+)(\d+)$", name)
        if m:
            out.append((m.group(1), int(m.group(2))))
    return out


def _of_vendor(candidates: Sequence[Card], vendor: str | None) -> list[Card]:
    return [c for c in candidates if c.vendor == vendor]


def _resolve(candidates: Sequence[Card], backend: str, index: int) -> list[Card] | None:
    """The card a backend's index names, or None where its numbering is not known: only
    CUDA's is (CUDA_DEVICE_ORDER=PCI_BUS_ID), or a vendor's single card; Vulkan numbers any
    vendor's cards in the driver's order."""
    vendor = _BACKEND_VENDOR.get(backend.lower())
    if vendor is None:
        vendors = {c.vendor for c in candidates}
        vendor = next(iter(vendors)) if len(vendors) == 1 else None
    own = _of_vendor(candidates, vendor)
    if len(own) == 1 and index == 0:
        return own
    if vendor == NVIDIA and backend.lower() == "cuda" and index < len(own):
        return [own[index]]
    return None


def _by_names(candidates: Sequence[Card], slots: Sequence[tuple[str, int]], args: ChildArgs,
              ratios: list[float] | None) -> tuple[list[Card], bool]:
    chosen: list[Card] = []
    assumed = False
    for i, (backend, index) in enumerate(slots):
        if not _kept(i, args, ratios):
            continue
        found = _resolve(candidates, backend, index)
        if found is None:
            assumed = True
            vendor = _BACKEND_VENDOR.get(backend.lower())
            found = _of_vendor(candidates, vendor) if vendor else list(candidates)
        chosen += [c for c in found if c not in chosen]
    return chosen, assumed


def _by_position(candidates: Sequence[Card], args: ChildArgs,
                 ratios: list[float] | None) -> tuple[list[Card], bool]:
    """Without -dev, llama.cpp numbers every GPU it sees; across vendors the order is the
    backends', so a position is known only for NVIDIA's cards alone (or a single card)."""
    kept = [c for i, c in enumerate(candidates) if _kept(i, args, ratios)]
    ordered = {c.vendor for c in candidates} <= {NVIDIA} or len(candidates) <= 1
    if len(kept) < len(candidates) and not ordered:
        return list(candidates), True
    return kept, False


def _kept(i: int, args: ChildArgs, ratios: list[float] | None) -> bool:
    """Whether device number `i` of its list gets layers: -sm none keeps -mg alone; a zero
    in -ts leaves that device out."""
    if args.split_mode is not None and args.split_mode.strip() == "none":
        main = args.main_gpu.strip() if args.main_gpu else "0"
        return main.isdigit() and int(main) == i
    if ratios is not None and i < len(ratios):
        return ratios[i] > 0
    return True


def _shares(ids: Sequence[str], ratios: list[float] | None) -> Mapping[str, float] | None:
    """-ts ratios over the devices in use, when they line up one to one."""
    if not ratios:
        return None
    kept = [r for r in ratios if r > 0]
    if len(kept) != len(ids) or sum(kept) <= 0:
        return None
    total = sum(kept)
    return {pci: r / total for pci, r in zip(ids, kept, strict=True)}


# --- room -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Room:
    """One card's free memory, as the headroom rule and the fit check weigh it."""

    pci_bus_id: str
    label: str  # "0000:03:00.0 AMD Radeon RX 7900 XTX", for messages
    free_bytes: int
    total_bytes: int


def tightest(rooms: Sequence[Room]) -> Room | None:
    """The card with the least free memory: the headroom rule holds on every card when it
    holds on this one (the headroom is the same on each)."""
    return min(rooms, key=lambda r: r.free_bytes) if rooms else None


def short_of(rooms: Sequence[Room], need_bytes: int, headroom_bytes: int,
             shares: Mapping[str, float] | None = None) -> tuple[Room, int] | None:
    """The first card that cannot take its part of `need_bytes` and keep the headroom, with
    the part it would need; None when all can. Without `-ts` llama.cpp splits the layers in
    proportion to each card's free memory, so that is the part assumed."""
    if not rooms:
        return None
    if shares is None:
        total_free = sum(max(0, r.free_bytes) for r in rooms)
        shares = {r.pci_bus_id: (max(0, r.free_bytes) / total_free if total_free else
                                 1 / len(rooms)) for r in rooms}
    for room in rooms:
        part = int(need_bytes * shares.get(room.pci_bus_id, 0.0)) + headroom_bytes
        if room.free_bytes < part:
            return room, part
    return None


# --- what a process's environment lets it see --------------------------------------------------

# The variables that narrow which cards a process sees, by vendor: ROCR's first, then HIP's
# numbering what ROCR left (the ROCm documentation's order).
VISIBILITY = (("CUDA_VISIBLE_DEVICES", NVIDIA), ("ROCR_VISIBLE_DEVICES", AMD),
              ("HIP_VISIBLE_DEVICES", AMD))


def visible(cards: Sequence[Card], env: Mapping[str, str]) -> list[Card]:
    """The cards a process with this environment can see. Each variable lists indices (in PCI
    order: CUDA's under CUDA_DEVICE_ORDER=PCI_BUS_ID; ROCm's assumed) or UUIDs (a prefix, as
    CUDA allows); as CUDA does, the list ends at the first entry that names nothing, so "" and
    "-1" hide every card of that vendor."""
    out = list(cards)
    for var, vendor in VISIBILITY:
        value = env.get(var)
        if value is not None:
            out = _narrow(out, vendor, value)
    return out


def _narrow(cards: Sequence[Card], vendor: str, value: str) -> list[Card]:
    own = [c for c in cards if c.vendor == vendor]
    keep: list[Card] = []
    for token in (t.strip() for t in value.split(",")):
        found = None
        if token.isdigit():
            found = own[int(token)] if int(token) < len(own) else None
        elif token.upper().startswith("GPU-") and len(token) > 4:
            wanted = token[4:].lower()
            found = next((c for c in own if c.uuid.lower().removeprefix("gpu-")
                          .removeprefix("0x").startswith(wanted)), None)
        if found is None:
            break
        keep.append(found)
    return [c for c in cards if c.vendor != vendor or c in keep]
