#!/usr/bin/env bash
# The drill and the profiles on a real GPU machine, end to end, in one run of a few minutes.
#
#   scripts/gpu/drill.sh
#
# What it proves, on the card: the drill's eleven scenarios with a real out-of-memory (ballast)
# where they can have one (1 to 5 and 10; 6 is router mode's and 8 needs a small child, so both
# are skipped here; 7 and 11 are Spillway's SIGABRT even on a GPU, 11 the GPU child back while
# the CPU child answers: expect `waited` or `failed_back`), and scenario 9: the model is given a
# projector (the tiny vision and audio one, tests/tinymm.py, sized to the model's width), and an
# image request (a PNG, first in its message, then the long prompt) reaches the GPU child while
# the ballast leaves it a few MiB, so that the allocations its image and prompt need there fail;
# the bar is that the image request is answered by the CPU child with its image (replayed: its
# incident says so, and its prompt counts the image's tokens), the plain requests sent meanwhile
# are answered, and the GPU child comes back READY. The drill does not tell whether the first
# allocation to fail was the vision encoder's or the prompt's that follows it (the child's own
# log in spillway.log may); a tiny projector's encoder needs little memory, so it may well be
# the prompt's. Scenario 10: a long conversation (a system prompt of PROMPT_TOKENS) is mirrored
# to the CPU child (mirroring is on for a hot CPU child), and its second turn, lost by the GPU
# child to the ballast, is answered by the CPU child from its cache, its first token timed
# against a cold conversation's of the same length (the CPU child's prefill of PROMPT_TOKENS on
# this machine's cores). The CPU child has one slot: the cold turn takes it, and the warm
# conversation waits in its host cache (llama-server's --cache-ram) meanwhile.
#
# Environment:
#   LLAMA_SERVER  a CUDA llama-server (or LLAMA_SERVER_XZ: the .xz that
#                 build-cuda-llama-server.sh made)
#   WHEELS        a folder of wheels for this machine's Python (pip download), when there is
#                 no network
#   OUT           where the report goes (default: ./gpu-report)
#   PROMPT_TOKENS the request over the GPU's profile (default 24000, as measured on an H200)
# The machine's own PyTorch provides the ballast (a raw allocation of all but a few MiB) and
# the CUDA runtime libraries the binary loads.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
out=$(mkdir -p "${OUT:-$PWD/gpu-report}" && cd "${OUT:-$PWD/gpu-report}" && pwd)
started=$(date +%s)
say() { echo "gpu-drill [$(( $(date +%s) - started ))s] $*" >&2; }

say "python environment (sees the machine's PyTorch)"
python3 -m venv --system-site-packages "$out/venv"
pip=("$out/venv/bin/pip" install --quiet --disable-pip-version-check)
if [ -n "${WHEELS:-}" ]; then pip+=(--no-index --find-links "$WHEELS"); fi
"${pip[@]}" -e "$repo" gguf numpy
py="$out/venv/bin/python"

if [ -z "${LLAMA_SERVER:-}" ] && [ -n "${LLAMA_SERVER_XZ:-}" ]; then
  xz -dc "$LLAMA_SERVER_XZ" > "$out/llama-server" && chmod +x "$out/llama-server"
  LLAMA_SERVER="$out/llama-server"
fi
: "${LLAMA_SERVER:?set LLAMA_SERVER (a CUDA build) or LLAMA_SERVER_XZ}"
nvlib=$("$py" -c 'import nvidia, os; print(os.path.join(os.path.dirname(nvidia.__path__[0]), "nvidia", "cu13", "lib"))' 2>/dev/null || true)
export LD_LIBRARY_PATH="${nvlib}:${LD_LIBRARY_PATH:-}"
"$LLAMA_SERVER" --list-devices >&2

say "a model made here (Q8_0 weights go through the pool CUDA grows at run time)"
"$py" "$repo/tests/tinymodel.py" "$out/q8.gguf" --q8 --n-embd 512 --n-layer 8 --n-ff 1024 \
  --n-ctx-train 32768 >/dev/null
say "and its projector (vision and audio; its output as wide as the model's embedding)"
"$py" "$repo/tests/tinymm.py" "$out/mmproj.gguf" --n-embd-text 512 >/dev/null

port=$("$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
cat > "$out/spillway.toml" <<TOML
[server]
listen = "127.0.0.1:$port"
[model]
llama_server = "$LLAMA_SERVER"
path = "$out/q8.gguf"
args = ["-c", "32768", "-np", "1", "--mmproj", "$out/mmproj.gguf"]
[gpu]
args = ["-ngl", "99", "-b", "4096", "-ub", "4096", "-fit", "off"]
vram_headroom_mib = 0
[cpu]
args = ["--device", "none", "-ngl", "0", "-c", "32768"]
[incidents]
path = "$out/incidents.jsonl"
[monitor]
sample_interval_s = 0.25
TOML
"$out/venv/bin/spillway" check-config "$out/spillway.toml"

say "spillway"
"$out/venv/bin/spillway" run --config "$out/spillway.toml" > "$out/spillway.log" 2>&1 &
daemon=$!
trap 'kill -TERM $daemon 2>/dev/null; wait $daemon 2>/dev/null' EXIT
for _ in $(seq 120); do
  if "$out/venv/bin/spillway" status --config "$out/spillway.toml" --json 2>/dev/null \
      | "$py" -c 'import json,sys; s=json.load(sys.stdin); sys.exit(0 if all(c["state"]=="READY" for c in s["children"].values()) else 1)'; then
    break
  fi
  sleep 1
done

say "the drill (ballast: PyTorch) and the profiles"
set +e
"$out/venv/bin/spillway" drill --config "$out/spillway.toml" --out "$out" --profiles \
  --prompt-tokens "${PROMPT_TOKENS:-24000}" | tee "$out/drill.txt"
code=${PIPESTATUS[0]}
set -e
"$out/venv/bin/spillway" status --config "$out/spillway.toml" > "$out/status.txt" || true
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
say "done (drill exit $code); report in $out"
exit "$code"
