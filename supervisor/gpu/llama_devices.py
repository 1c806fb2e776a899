"""The accelerators a llama-server binary can use, as it lists them itself (`--list-devices`).

A driver can be present while the binary is CPU-only (and the reverse), so what decides whether
the GPU child runs on a GPU is the binary's own listing, not the driver's.
"""

from __future__ import annotations

import os
import re
import subprocess

_DEVICE_LINE = re.compile(r"^\s+([A-Za-z]+\d+):\s*(.*)$")


def list_devices(llama_server: str, timeout_s: float = 30.0,
                 env: dict[str, str] | None = None) -> list[str]:
    """The accelerators a llama-server binary can use, from `--list-devices` (e.g.
    `CUDA0: NVIDIA H200 (143771 MiB, 142000 MiB free)`); empty for a CPU-only build."""
    try:
        out = subprocess.run([llama_server, "--list-devices"], capture_output=True, text=True,
                             timeout=timeout_s, errors="replace",
                             env={**os.environ, "GGML_NO_BACKTRACE": "1", **(env or {})})
    except (OSError, subprocess.TimeoutExpired):
        return []
    devices = []
    listing = False
    for line in (out.stdout + "\n" + out.stderr).splitlines():
        if line.strip().startswith("Available devices"):
            listing = True
            continue
        if listing:
            m = _DEVICE_LINE.match(line)
            if m:
                devices.append(f"{m.group(1)}: {m.group(2)}".strip())
    return devices
