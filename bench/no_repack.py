"""What `--no-repack` costs on a CPU without AMX: the price of the runtime fix for llama.cpp's
AMX crash (llama.cpp#20824), against the same binary without it, in the same run.

The embedded build leaves AMX out at the compiler instead (build_recipe.py), which costs
nothing on a CPU without AMX (the same code) and keeps weight repacking (CPU_REPACK) on every
CPU. `--no-repack` turns off all of llama.cpp's extra CPU buffer types, AMX and CPU_REPACK
alike; this measures what that takes away where AMX was never the problem.

    .venv/bin/python -m bench.no_repack --model FILE.gguf [--model OTHER.gguf] [--rounds 3]

For each model: llama-server (the embedded build) with and without --no-repack, one slot,
alternating runs; each run a ~300-token prompt (prompt tokens/s) and 128 greedy tokens
(generated tokens/s), read from the server's own timings. Prints medians and the ratio
no-repack / default, and writes bench/results/no_repack.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from supervisor.commands import bootstrap  # noqa: E402
from supervisor.upstreams.hostcpu import host_cpu  # noqa: E402
from supervisor.upstreams.launcher import pick_port  # noqa: E402

PROMPT = " ".join(["The supervisor keeps the server answering when memory runs short, and the "
                   "second worker finishes the request without losing the job."] * 12)


def _post(port: int, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        answer: dict[str, Any] = json.load(resp)
    return answer


def _wait_ready(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("llama-server not ready in 120 s")


def one_run(binary: Path, model: Path, no_repack: bool) -> dict[str, float]:
    port = pick_port()
    args = [str(binary), "-m", str(model), "--port", str(port), "-c", "2048", "-np", "1",
            "--device", "none", "-ngl", "0", "-lv", "4"]
    if no_repack:
        args.append("--no-repack")
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_ready(port, proc)
        _post(port, {"prompt": "warm up", "n_predict": 4})
        answer = _post(port, {"prompt": PROMPT, "n_predict": 128, "temperature": 0,
                              "ignore_eos": True, "cache_prompt": False})
        t = answer["timings"]
        return {"prompt_tps": t["prompt_per_second"], "gen_tps": t["predicted_per_second"],
                "prompt_n": t["prompt_n"], "gen_n": t["predicted_n"]}
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
        buffers = sorted({line.split("model buffer")[0].split()[-1]
                          for line in err.decode(errors="replace").splitlines()
                          if "model buffer size" in line})
        print(f"  {'--no-repack' if no_repack else 'default    '} buffers: {buffers}",
              file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", action="append", required=True, type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    binary = bootstrap.ensure_llama_server()
    results: dict[str, Any] = {"cpu": host_cpu().describe(), "binary": str(binary),
                               "build": bootstrap.build_info(binary), "models": {}}
    for model in args.model:
        runs: dict[str, list[dict[str, float]]] = {"default": [], "no_repack": []}
        for _ in range(args.rounds):  # alternating, so drift in the machine hits both alike
            runs["default"].append(one_run(binary, model, no_repack=False))
            runs["no_repack"].append(one_run(binary, model, no_repack=True))
        med = {name: {k: statistics.median(r[k] for r in rs) for k in ("prompt_tps", "gen_tps")}
               for name, rs in runs.items()}
        results["models"][model.name] = {"runs": runs, "median": med, "ratio": {
            k: med["no_repack"][k] / med["default"][k] for k in ("prompt_tps", "gen_tps")}}
    lines = [f"# --no-repack on {results['cpu']}", "",
             "| model | prompt t/s default | prompt t/s --no-repack | ratio | gen t/s default "
             "| gen t/s --no-repack | ratio |", "|---|---|---|---|---|---|---|"]
    for name, r in results["models"].items():
        d, n, q = r["median"]["default"], r["median"]["no_repack"], r["ratio"]
        lines.append(f"| {name} | {d['prompt_tps']:.0f} | {n['prompt_tps']:.0f} | "
                     f"{q['prompt_tps']:.2f} | {d['gen_tps']:.1f} | {n['gen_tps']:.1f} | "
                     f"{q['gen_tps']:.2f} |")
    lines += ["", f"medians of {args.rounds} alternating runs each; one slot, 2048 context, "
              "~300 prompt tokens, 128 greedy tokens; the server's own timings"]
    text = "\n".join(lines)
    print(text)
    out = REPO / "bench" / "results"
    (out / "no_repack.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "no_repack.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
