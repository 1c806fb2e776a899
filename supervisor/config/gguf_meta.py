"""Just enough of GGUF to estimate a child's KV cache: the model's shape from its metadata.

The CPU guard of admission needs "model file plus KV estimate" before the CPU child is started
cold; the KV cache is n_layer x n_ctx x (keys + values per token) elements. This reads the
metadata section of the file (not the tensors), skipping what it does not need.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

_MAGIC = b"GGUF"
# GGUF value types -> struct format (fixed sizes); 8 = string, 9 = array
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
          12: "d"}
_STRING, _ARRAY = 8, 9


class GgufError(Exception):
    pass


@dataclass(frozen=True)
class ModelShape:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    key_length: int
    value_length: int
    n_ctx_train: int

    def kv_bytes(self, n_ctx: int, bytes_per_element: float = 2.0) -> int:
        """The KV cache for `n_ctx` tokens in f16 (llama-server's default cache type)."""
        per_token = self.n_head_kv * (self.key_length + self.value_length)
        return int(self.n_layer * n_ctx * per_token * bytes_per_element)


def _read(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise GgufError("truncated GGUF metadata")
    return data


def _string(f: BinaryIO) -> bytes:
    (n,) = struct.unpack("<Q", _read(f, 8))
    return _read(f, n)


def _value(f: BinaryIO, vtype: int, keep: bool) -> Any:
    if vtype in _FIXED:
        fmt = "<" + _FIXED[vtype]
        (v,) = struct.unpack(fmt, _read(f, struct.calcsize(fmt)))
        return v
    if vtype == _STRING:
        s = _string(f)
        return s.decode("utf-8", "replace") if keep else None
    if vtype == _ARRAY:
        (etype,) = struct.unpack("<I", _read(f, 4))
        (count,) = struct.unpack("<Q", _read(f, 8))
        if etype in _FIXED:
            f.seek(count * struct.calcsize("<" + _FIXED[etype]), 1)
        else:
            for _ in range(count):
                _value(f, etype, keep=False)
        return None
    raise GgufError(f"unknown GGUF value type {vtype}")


def read_metadata(path: str) -> dict[str, Any]:
    """The scalar and string metadata of a GGUF file (arrays are skipped)."""
    with open(path, "rb") as f:
        if _read(f, 4) != _MAGIC:
            raise GgufError(f"{path} is not a GGUF file")
        (version,) = struct.unpack("<I", _read(f, 4))
        if version < 2:
            raise GgufError(f"GGUF version {version} is too old")
        _tensors, kv_count = struct.unpack("<QQ", _read(f, 16))
        meta: dict[str, Any] = {}
        for _ in range(kv_count):
            key = _string(f).decode("utf-8", "replace")
            (vtype,) = struct.unpack("<I", _read(f, 4))
            value = _value(f, vtype, keep=True)
            if value is not None:
                meta[key] = value
        return meta


def model_shape(path: str) -> ModelShape:
    meta = read_metadata(path)
    arch = str(meta.get("general.architecture", "llama"))

    def num(key: str, default: int | None = None) -> int:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise GgufError(f"{path}: no {arch}.{key} in the metadata")
        return int(value)

    n_embd = num("embedding_length")
    n_head = num("attention.head_count")
    head_dim = n_embd // max(1, n_head)
    return ModelShape(
        arch=arch,
        n_layer=num("block_count"),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=num("attention.head_count_kv", n_head),
        key_length=num("attention.key_length", head_dim),
        value_length=num("attention.value_length", head_dim),
        n_ctx_train=num("context_length", 4096),
    )
