#!/usr/bin/env bash
# The wheels Spillway (and the drill's model maker) need on a GPU machine without network,
# for its Python (3.12 on the H200 host), fetched here:
#
#   scripts/gpu/fetch-wheels.sh OUT_DIR [PYTHON_VERSION]
#
# Then, there: WHEELS=OUT_DIR scripts/gpu/drill.sh
set -euo pipefail
out=${1:?usage: fetch-wheels.sh OUT_DIR [PYTHON_VERSION]}
py=${2:-3.12}
mkdir -p "$out"
python3 -m pip download --quiet --disable-pip-version-check --dest "$out" \
  --python-version "$py" --only-binary=:all: \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  aiohttp psutil nvidia-ml-py watchdog prometheus-client gguf numpy "setuptools>=68" wheel
# sdnotify is pure Python and published only as a source archive.
python3 -m pip download --quiet --disable-pip-version-check --dest "$out" --no-deps \
  --no-binary :all: sdnotify
ls "$out" | wc -l
