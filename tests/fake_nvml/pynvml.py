"""A fake `pynvml` (test double) that reports chosen GPU memory figures.

Tests put this folder first on the daemon's PYTHONPATH. The figures are read from the JSON file
named by FAKE_NVML_FILE on every call, so a test can change them while the daemon runs:

    {"total_mib": 24576, "free_mib": 20000, "name": "Fake GPU",
     "pci_bus_id": "00000000:01:00.0", "processes": {"1234": 3858}}

or several cards: `{"devices": [{...}, {...}]}`, each with those keys.

`{"init_error": "LibraryNotFound"}` makes nvmlInit fail as the real library does without a
driver. Only the calls Spillway makes exist.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

MIB = 1024 * 1024


class NVMLError(Exception):
    def __init__(self, value: int = 999, message: str = "Unknown Error") -> None:
        super().__init__(message)
        self.value = value
        self.message = message

    def __str__(self) -> str:
        return self.message


class NVMLError_LibraryNotFound(NVMLError):
    def __init__(self) -> None:
        super().__init__(12, "NVML Shared Library Not Found")


class NVMLError_DriverNotLoaded(NVMLError):
    def __init__(self) -> None:
        super().__init__(9, "Driver Not Loaded")


class NVMLError_NotFound(NVMLError):
    def __init__(self) -> None:
        super().__init__(6, "Not Found")


def _figures() -> dict[str, Any]:
    with open(os.environ["FAKE_NVML_FILE"]) as f:
        data: dict[str, Any] = json.load(f)
    return data


def nvmlInit() -> None:
    err = _figures().get("init_error")
    if err == "LibraryNotFound":
        raise NVMLError_LibraryNotFound()
    if err == "DriverNotLoaded":
        raise NVMLError_DriverNotLoaded()


def nvmlShutdown() -> None:
    pass


def _devices() -> list[dict[str, Any]]:
    """The cards: `devices`, a list of the single card's keys; or the file itself, one card."""
    f = _figures()
    return list(f["devices"]) if "devices" in f else [f]


def _card(handle: int) -> dict[str, Any]:
    return _devices()[handle]


def nvmlDeviceGetCount() -> int:
    return len(_devices())


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    if not 0 <= index < len(_devices()):
        raise NVMLError_NotFound()
    return index


def nvmlDeviceGetIndex(handle: int) -> int:
    return handle


def nvmlDeviceGetMemoryInfo(handle: int) -> SimpleNamespace:
    f = _card(handle)
    total = int(f.get("total_mib", 24576)) * MIB
    free = int(f.get("free_mib", 20000)) * MIB
    return SimpleNamespace(total=total, free=free, used=total - free)


def nvmlDeviceGetComputeRunningProcesses(handle: int) -> list[SimpleNamespace]:
    procs = _card(handle).get("processes", {})
    return [SimpleNamespace(pid=int(pid), usedGpuMemory=int(mib) * MIB)
            for pid, mib in procs.items()]


def nvmlDeviceGetName(handle: int) -> str:
    return str(_card(handle).get("name", "Fake GPU"))


def nvmlDeviceGetPciInfo(handle: int) -> SimpleNamespace:
    return SimpleNamespace(busId=_card(handle).get("pci_bus_id", f"00000000:0{handle + 1}:00.0"))


def nvmlDeviceGetUUID(handle: int) -> str:
    return str(_card(handle).get("uuid", f"GPU-fake-000{handle}"))
