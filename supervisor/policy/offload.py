"""How much of the GPU child is on the GPU: its load log and its own memory, read.

After a driver update, or on a card its build does not support, llama-server loads with none of
its layers on the GPU, or fewer than asked, and answers at CPU speed (ollama/ollama#15918,
#17841). This reads what the pinned llama.cpp prints while loading and compares the child's own
memory on its cards with the model's size. Pure: the lines and the figures are given.

The lines (llama.cpp as pinned: src/llama-model.cpp, common/arg.cpp, the backends' init):

- `warning: no usable GPU found, --gpu-layers option will be ignored`: common/arg.cpp, printed
  with fprintf at any verbosity when `-ngl` is given and the process has no GPU device at all (a
  CPU-only build, or every backend failed to start). Conclusive: none.
- `ggml_cuda_init: failed to initialize CUDA: <cudaGetErrorString>` (`ROCm`, `MUSA` for those
  builds of ggml-cuda), `ggml_cann_init: failed to initialize CANN: ...`,
  `SYCL: failed to initialize: ggml_sycl_init` (GGML_LOG_ERROR: any verbosity) and
  `ggml_vulkan: No devices found.` (INFO: only at `-lv 4`): that backend did not start.
- `load_tensors: offloaded N/M layers to GPU` and `load_tensors: <buffer> model buffer size = X
  MiB` (INFO: only at `-lv 4`; llama-server's default verbosity is 3). M is the block count plus
  the output layer. N is min(-ngl, M) even when the process has no device to put them on (the
  count is printed whenever the build could offload, e.g. with `-dev none`), so N counts only
  when a model buffer of a device (`CUDA0`, `ROCm0`, `Vulkan0`, `Metal`, ...: not `CPU`,
  `CPU_Mapped`, `CPU_REPACK`, `AMX`, nor a pinned `CUDA_Host`) was made; without one it is 0.

Where the line is drawn, in this order (the first that applies decides):

1. `-ngl 0` or `-dev none` asked for no layers on the GPU: none, as asked.
2. `no usable GPU found` in the log: none.
3. The layer count of a `-lv 4` log (with its buffers, as above): N of M. 0 is none; fewer than
   asked is partial; all (or as many as asked) is full.
4. Its own memory on its cards (the sum of its pid's figures over the cards it uses, after it
   is ready), against the model file's size: under NONE_FRACTION (10 %) of the model is none
   (it holds no weights: a process whose backend did not start holds nothing at all);
   FULL_FRACTION (80 %) or more is full (the weights fit in what it holds; the input layer,
   always on the CPU, is at most a few percent of a model, and the KV cache, the compute buffers
   and the backend's context only add to the figure); in between is partial. Unless: -ngl asked
   for fewer than all (some of it is on the GPU: partial, as asked, however many), `-fit on`
   chose (partial is what it chose), or `-ot` / `--cpu-moe` / `--n-cpu-moe` keep weights on the
   CPU on purpose (the memory cannot tell: unknown). A pid holding nothing while another
   process on its cards holds at least FULL_FRACTION of the model is unknown, not none: the
   card may list the child under another pid namespace (a container).
5. A backend init failure line, and no memory figures: none.
6. Else unknown: no per-process figures (a card whose process list is empty may not report
   processes at all), and a log at the default verbosity that says nothing of offload.

"Fewer than asked" (`short`) is none or partial when more was asked: -ngl N (N > 0), `all`, or
`auto` (with `-fit off`, as Spillway runs the GPU child, auto is all; with fit on, llama.cpp
chooses, and only none is short).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

FULL = "full"
PARTIAL = "partial"
NONE = "none"
UNKNOWN = "unknown"

NONE_FRACTION = 0.10
FULL_FRACTION = 0.80
MIB = 1024 * 1024

# The incident kinds of a GPU child with fewer layers on the GPU than asked.
KIND_NONE = "no_offload"
KIND_PARTIAL = "partial_offload"

NO_GPU = re.compile(r"warning: no usable GPU found, --gpu-layers option will be ignored")
_INIT_FAILURES = (
    (re.compile(r"ggml_cuda_init: failed to initialize (CUDA|ROCm|MUSA): .*"), None),
    (re.compile(r"ggml_cann_init: failed to initialize CANN: .*"), "CANN"),
    (re.compile(r"SYCL: failed to initialize: ggml_sycl_init"), "SYCL"),
    (re.compile(r"ggml_vulkan: No devices found\."), "Vulkan"),
)
OFFLOADED = re.compile(r"load_tensors: offloaded (\d+)/(\d+) layers to GPU")
BUFFER = re.compile(r"load_tensors:\s+(\S+) model buffer size =\s+([0-9.]+) MiB")
_HOST_BUFFER = re.compile(r"CPU|_Host$|^AMX$|^ZenDNN", re.IGNORECASE)


def is_device_buffer(name: str) -> bool:
    """A model buffer in a device's memory (`CUDA0`, `Vulkan0`, `Metal`), not the host's
    (`CPU`, `CPU_Mapped`, `CPU_REPACK`, `AMX`, a pinned `CUDA_Host`)."""
    return _HOST_BUFFER.search(name) is None


@dataclass
class LoadLog:
    """What one process's output said of offload; fed its lines as they come."""

    offloaded: int | None = None
    total: int | None = None
    device_buffers: dict[str, float] = field(default_factory=dict)  # name -> MiB
    host_buffers: dict[str, float] = field(default_factory=dict)
    no_gpu: str | None = None  # the `no usable GPU found` line
    init_failure: str | None = None  # a backend's failed start, as printed
    backend: str | None = None  # whose: "CUDA", "ROCm", "Vulkan", ...

    def reset(self) -> None:
        """A new process: nothing known yet."""
        fresh = LoadLog()
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(fresh, name))

    def feed(self, line: str) -> None:
        if (m := OFFLOADED.search(line)) is not None:
            self.offloaded, self.total = int(m.group(1)), int(m.group(2))
        elif (m := BUFFER.search(line)) is not None:
            name, mib = m.group(1), float(m.group(2))
            kept = self.device_buffers if is_device_buffer(name) else self.host_buffers
            kept[name] = kept.get(name, 0.0) + mib
        elif (m := NO_GPU.search(line)) is not None:
            self.no_gpu = m.group(0)
        else:
            for pattern, backend in _INIT_FAILURES:
                if (m := pattern.search(line)) is not None and self.init_failure is None:
                    self.init_failure = m.group(0)
                    self.backend = backend or m.group(1)

    @property
    def layers_on_gpu(self) -> int | None:
        """N of `offloaded N/M`, counted only when a device's model buffer was made (None
        without the line; 0 when every model buffer is the host's)."""
        if self.offloaded is None:
            return None
        if self.host_buffers and not any(v > 0 for v in self.device_buffers.values()):
            return 0
        return self.offloaded


@dataclass(frozen=True)
class Asked:
    """What the GPU child's args ask for."""

    layers: int | None  # a number of layers; None: all of them
    given: str  # as said to people: "-ngl 99", "-ngl all", "-ngl auto (-fit off)", ...
    fit: bool = False  # auto with fit on: llama.cpp chooses how many
    overrides: bool = False  # -ot / --cpu-moe / --n-cpu-moe: weights kept on the CPU on purpose

    def count(self, total: int | None) -> int | None:
        """How many layers that is, out of `total` (None when not known)."""
        if self.fit:
            return None
        if self.layers is None:
            return total
        return min(self.layers, total) if total is not None else self.layers


def asked(ngl: str | None, fit: str | None = None, device: str | None = None,
          overrides: bool = False) -> Asked:
    """From the GPU child's args: the value of -ngl (any spelling, or LLAMA_ARG_N_GPU_LAYERS),
    of -fit and of -dev, and whether tensors are overridden. llama.cpp's default -ngl is auto;
    a negative number is auto (-1) or all (<= -2), as common/arg.cpp parses it."""
    fit_on = (fit or "off").strip().lower() in ("on", "1", "true", "enabled")
    if device is not None and device.strip().lower() == "none":
        return Asked(0, "-dev none", overrides=overrides)
    value = (ngl or "auto").strip().lower()
    if value == "all":
        return Asked(None, "-ngl all", overrides=overrides)
    if value != "auto":
        try:
            n = int(value)
        except ValueError:
            n = -1  # llama-server would refuse it: judged as its default
        if n >= 0:
            return Asked(n, f"-ngl {n}", overrides=overrides)
        if n <= -2:
            return Asked(None, f"-ngl {value}", overrides=overrides)
    said = "-ngl auto" if ngl is not None else "-ngl unset (auto)"
    if fit_on:
        return Asked(None, f"{said} (-fit on)", fit=True, overrides=overrides)
    return Asked(None, f"{said} (-fit off: all)", overrides=overrides)


@dataclass(frozen=True)
class Memory:
    """The GPU child's own memory on the cards it uses, from the last sample after it was
    ready."""

    held_bytes: int | None  # its pid's, summed over its cards; None: no per-process figures
    model_bytes: int | None  # the model file's size
    others_max_bytes: int = 0  # the most another process holds on one of its cards


@dataclass(frozen=True)
class Verdict:
    state: str  # full | partial | none | unknown
    why: str  # for people
    offloaded: int | None = None
    total: int | None = None
    asked: int | None = None
    short: bool = False  # fewer layers on the GPU than asked
    source: str = ""  # what decided: "args", "log", "memory", "" (nothing)

    @property
    def kind(self) -> str | None:
        """The incident's kind when it is short of what was asked."""
        if not self.short:
            return None
        return KIND_NONE if self.state == NONE else KIND_PARTIAL

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": self.state, "why": self.why, "short": self.short,
                               "source": self.source or None}
        if self.total is not None or self.offloaded is not None or self.asked is not None:
            out["layers"] = {"offloaded": self.offloaded, "total": self.total,
                             "asked": self.asked}
        return out


def pending(why: str) -> Verdict:
    return Verdict(UNKNOWN, why)


def _mib(n: int | float) -> str:
    return f"{n / MIB:.0f} MiB"


def _holding(memory: Memory) -> str:
    if memory.held_bytes is None:
        return ""
    size = f" for a {_mib(memory.model_bytes)} model" if memory.model_bytes else ""
    return f"it holds {_mib(memory.held_bytes)} of VRAM{size}"


def _none_layers(total: int | None) -> str:
    return f"0 of {total} layers on the GPU" if total is not None else \
        "none of its layers on the GPU"


def judge(log: LoadLog, wanted: Asked, memory: Memory, n_layer: int | None = None) -> Verdict:
    """The verdict on one process of the GPU child (see the module's docstring for the
    rule). `n_layer`: the model's block count, if known (M is n_layer + 1)."""
    total = log.total if log.total is not None else (n_layer + 1 if n_layer else None)
    asked_n = wanted.count(total)
    wants_some = wanted.fit or asked_n is None or asked_n > 0

    # 1. Asked for none.
    if not wanted.fit and wanted.layers == 0:
        return Verdict(NONE, f"{_none_layers(total)}, as asked ({wanted.given})", offloaded=0,
                       source="args", total=total, asked=asked_n)

    # 2. llama-server says it has no GPU at all.
    if log.no_gpu is not None:
        held = _holding(memory)
        return Verdict(NONE, f"{_none_layers(total)}: "
                       + (f"{held} (llama-server: no usable GPU found)" if held else
                          f"llama-server: {log.no_gpu.removeprefix('warning: ')}"),
                       offloaded=0, short=wants_some, source="log", total=total, asked=asked_n)

    # 3. The layer count of a -lv 4 log.
    n = log.layers_on_gpu
    if n is not None:
        return _by_count(n, total, asked_n, wanted, log)

    # 4. Its own memory against the model's size.
    by_memory = _by_memory(wanted, memory, total, asked_n, log)
    if by_memory is not None:
        return by_memory

    # 5. A backend's failed start, with nothing else to go on.
    if log.init_failure is not None:
        return Verdict(NONE, f"{_none_layers(total)}: the {log.backend} backend did not "
                       f"start: {log.init_failure}", offloaded=0, short=wants_some,
                       source="log", total=total, asked=asked_n)

    # 6. Nothing to go on.
    figures = ("no per-process memory figures for its cards" if memory.held_bytes is None
               else "the model's size is not known")
    return Verdict(UNKNOWN, f"not known: its load log says nothing of offload at this "
                   f"verbosity (llama-server prints its layer count at -lv 4), and {figures}",
                   total=total, asked=asked_n)


def _by_count(n: int, total: int | None, asked_n: int | None, wanted: Asked,
              log: LoadLog) -> Verdict:
    def verdict(state: str, why: str, short: bool = False) -> Verdict:
        return Verdict(state, why, offloaded=n, total=total, asked=asked_n, short=short,
                       source="log")

    of = f"{n} of {total} layers on the GPU" if total is not None else \
        f"{n} layers on the GPU"
    if n == 0:
        cause = (f": the {log.backend} backend did not start: {log.init_failure}"
                 if log.init_failure else
                 ": every model buffer is in host memory" if log.offloaded else "")
        return verdict(NONE, f"{of}{cause}", short=wanted.fit or asked_n != 0)
    if total is not None and n >= total:
        return verdict(FULL, of)
    if asked_n is not None and n < asked_n:
        return verdict(PARTIAL, f"{of}, {asked_n} asked ({wanted.given})", short=True)
    return verdict(PARTIAL, f"{of}, " + ("as -fit chose" if wanted.fit else
                                         f"as asked ({wanted.given})"))


def _by_memory(wanted: Asked, memory: Memory, total: int | None, asked_n: int | None,
               log: LoadLog) -> Verdict | None:
    def verdict(state: str, why: str, offloaded: int | None = None,
                short: bool = False) -> Verdict:
        return Verdict(state, why, offloaded=offloaded, total=total, asked=asked_n,
                       short=short, source="memory")

    held, size = memory.held_bytes, memory.model_bytes or None
    if held is None or (size is None and held > 0):
        return None  # no figures; or some memory held, of a model of unknown size
    holding = _holding(memory)
    wants_some = wanted.fit or asked_n is None or asked_n > 0
    fraction = held / size if size else 0.0
    if fraction < NONE_FRACTION:
        if held == 0 and size and memory.others_max_bytes >= FULL_FRACTION * size:
            return verdict(UNKNOWN, f"not known: its pid holds nothing on its cards, but "
                           f"another process there holds {_mib(memory.others_max_bytes)} (as "
                           f"much as the {_mib(size)} model): the card may list the child "
                           f"under another pid (a container)")
        cause = (f" ({log.backend} did not start: {log.init_failure})" if log.init_failure
                 else "")
        return verdict(NONE, f"{_none_layers(total)}: {holding}{cause}", offloaded=0,
                       short=wants_some)
    if asked_n is not None and total is not None and asked_n < total:
        return verdict(PARTIAL, f"some of its layers on the GPU, as asked ({wanted.given}): "
                       f"{holding}")
    if fraction >= FULL_FRACTION:
        return verdict(FULL, f"all of its layers on the GPU: {holding}", offloaded=total)
    if wanted.overrides:
        return verdict(UNKNOWN, f"not known: {holding}, and -ot/--cpu-moe keep some weights "
                       f"on the CPU on purpose")
    if wanted.fit:
        return verdict(PARTIAL, f"part of it on the GPU, as -fit chose: {holding}")
    return verdict(PARTIAL, f"part of it on the GPU: {holding}, under "
                   f"{FULL_FRACTION:.0%} of the model, with all asked ({wanted.given})",
                   short=True)
