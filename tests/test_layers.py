"""The package's layers hold (import-linter, its contracts in pyproject.toml): commands >
service > proxy | router > serving > upstreams | gpu > records > config > vocabulary > policy;
the policy is pure (nothing of Spillway's outside it, no aiohttp, no asyncio); the vocabulary
names the policy's value types and nothing else of Spillway's; no cycles among a folder's
modules. docs/layout.md says what each layer is for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_the_import_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--no-cache"], cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout, result.stdout
