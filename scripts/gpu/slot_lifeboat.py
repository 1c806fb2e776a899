#!/usr/bin/env python3
"""Does a slot saved by one llama-server restore in another, and is the restored prefix used?

The check that keeps the KV "lifeboat" (docs/failover.md, "A warm CPU child") off until it
passes on a GPU: a llama-server with its layers on the GPU (SAVER) serves a long conversation's
first turn, saves its slot (`POST /slots/0?action=save`), a CPU-only llama-server (RESTORER:
`--device none -ngl 0`, the same GGUF, -c, -np, -fa, -ctk/-ctv) restores it
(`POST /slots/0?action=restore`) and serves the second turn. Printed: the save's and the
restore's time and size, the second turn's `timings.cache_n` against the first turn's prompt
tokens, and the same turn's time to first token from a cold CPU-only server (the mirroring it
would compete with). Exit 0 when the restored prefix is used (cache_n covers 80% of it).

    scripts/gpu/slot_lifeboat.py --saver LLAMA_SERVER --restorer LLAMA_SERVER --model GGUF
        [--saver-args "-ngl 99"] [--words 1500] [--out DIR]

Without a GPU it runs both CPU-only (the mechanics only: `--saver-args "--device none -ngl 0"`).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

COMMON = ["-c", "8192", "-np", "1", "-fa", "on", "-ctk", "f16", "-ctv", "f16", "--no-warmup"]
WORDS = ("the model reads a long document about memory and servers while the gpu holds every "
         "layer and the cpu waits for its turn ").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def call(port: int, path: str, body: Any = None, timeout: float = 600) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def start(binary: str, model: str, extra: list[str], slots: Path, log: Path) -> tuple[Any, int]:
    port = free_port()
    argv = [binary, "-m", model, "--port", str(port), "--slot-save-path", f"{slots}/",
            *COMMON, *extra]
    proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if call(port, "/health", timeout=2)[0] == 200:
                return proc, port
        except OSError:
            pass
        if proc.poll() is not None:
            sys.exit(f"{binary} exited with {proc.returncode}; see {log}")
        time.sleep(0.2)
    sys.exit(f"{binary} did not answer /health in 300 s; see {log}")


def chat(port: int, messages: list[dict[str, str]]) -> tuple[dict[str, Any], float]:
    began = time.monotonic()
    code, body = call(port, "/v1/chat/completions",
                      {"messages": messages, "max_tokens": 8, "temperature": 0,
                       "cache_prompt": True, "id_slot": 0})
    if code != 200:
        sys.exit(f"chat answered {code}: {body}")
    return body, time.monotonic() - began


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--saver", required=True)
    ap.add_argument("--restorer", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--saver-args", default="-ngl 99")
    ap.add_argument("--words", type=int, default=1500)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    out = Path(a.out or tempfile.mkdtemp(prefix="lifeboat-"))
    out.mkdir(parents=True, exist_ok=True)
    saver_slots, restorer_slots = out / "saver-slots", out / "restorer-slots"
    saver_slots.mkdir(exist_ok=True)
    restorer_slots.mkdir(exist_ok=True)
    system = " ".join(WORDS[i % len(WORDS)] for i in range(a.words))
    first = [{"role": "system", "content": system}, {"role": "user", "content": "summarise it"}]
    report: dict[str, Any] = {"saver_args": a.saver_args}

    saver, sport = start(a.saver, a.model, shlex.split(a.saver_args), saver_slots,
                         out / "saver.log")
    restorer, rport = start(a.restorer, a.model, ["--device", "none", "-ngl", "0"],
                            restorer_slots, out / "restorer.log")
    cold, cport = start(a.restorer, a.model, ["--device", "none", "-ngl", "0"],
                        out / "restorer-slots", out / "cold.log")
    try:
        one, _ = chat(sport, first)
        report["prefix_tokens"] = one["usage"]["prompt_tokens"]
        began = time.monotonic()
        code, saved = call(sport, "/slots/0?action=save", {"filename": "turn1.bin"})
        report["save"] = {"status": code, "answer": saved, "s": time.monotonic() - began}
        if code != 200:
            print(json.dumps(report, indent=2))
            return 1
        shutil.copy(saver_slots / "turn1.bin", restorer_slots / "turn1.bin")
        report["file_bytes"] = (restorer_slots / "turn1.bin").stat().st_size
        began = time.monotonic()
        code, restored = call(rport, "/slots/0?action=restore", {"filename": "turn1.bin"})
        report["restore"] = {"status": code, "answer": restored, "s": time.monotonic() - began}
        second = [*first, {"role": "assistant", "content": one["choices"][0]["message"]["content"]},
                  {"role": "user", "content": "and the gpu?"}]
        warm, warm_s = chat(rport, second)
        cold_answer, cold_s = chat(cport, second)
        report["warm"] = {"cache_n": warm["timings"].get("cache_n"),
                          "prompt_n": warm["timings"].get("prompt_n"), "s": warm_s}
        report["cold"] = {"cache_n": cold_answer["timings"].get("cache_n"),
                          "prompt_n": cold_answer["timings"].get("prompt_n"), "s": cold_s}
        report["restored_prefix_used"] = bool(
            code == 200 and (warm["timings"].get("cache_n") or 0) >= 0.8 * report["prefix_tokens"])
    finally:
        for proc in (saver, restorer, cold):
            proc.terminate()
            proc.wait(30)
    print(json.dumps(report, indent=2))
    (out / "lifeboat.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["restored_prefix_used"] else 1


if __name__ == "__main__":
    sys.exit(main())
