"""A tiny random-weight llama model in GGUF, written on the spot with the `gguf` package.

Its text is noise, but every server code path is real: it loads in about 0.1 s and generates
thousands of tokens per second on two cores, so integration tests can run a real llama-server.
Grow `n_ctx_train` or the dimensions to make memory use as large as a test needs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from "
    "or one had by word but not what all were we when your can said there use an each which "
    "she do how their if will up other about out many then them these so some her would make "
    "like him into time has look two more write go see number no way could people my than "
    "first water been call who oil its now find long down day did get come made may part hello "
    "world tool call answer question model memory server gpu cpu token spill way fast slow"
).split()


# A reasoning model's chat template (`reasoning=True`): Qwen3.5-4B's, as the pinned llama.cpp
# ships it in models/templates/ (and tests it in test-chat.cpp, continuations of reasoning and of
# content included). Its generation prompt opens a think block (`<think>\n`) unless
# `chat_template_kwargs: {"enable_thinking": false}`, so llama-server's autoparser (a TAG_BASED
# reasoning template) parses everything a random model generates as `reasoning_content`: the
# weights never emit `</think>`.
QWEN35_TEMPLATE = Path(__file__).with_name("templates") / "Qwen3.5-4B.jinja"
# Its markers, as tokens of their own (USER_DEFINED: always rendered as text, as Qwen's are).
REASONING_TOKENS = (b"<think>", b"</think>", b"<tool_call>", b"</tool_call>")

# Fill-in-the-middle tokens (`fim=True`): with them llama-server serves /infill, building the
# prompt from them as it does for a code model; without them it answers /infill with a 501.
FIM_TOKENS = (b"<|fim_prefix|>", b"<|fim_suffix|>", b"<|fim_middle|>")


def vocabulary(fim: bool = False, reasoning: bool = False,
               ) -> tuple[list[bytes], list[float], list[int]]:
    tokens: list[bytes] = [b"<unk>", b"<s>", b"</s>", b"<|im_start|>", b"<|im_end|>"]
    types = [2, 3, 3, 3, 3]  # UNKNOWN, CONTROL x4
    for b in range(256):
        tokens.append(f"<0x{b:02X}>".encode())
        types.append(6)  # BYTE
    seen = set()
    for w in WORDS:
        for piece in ("\u2581" + w, w):
            if piece not in seen:
                seen.add(piece)
                tokens.append(piece.encode())
                types.append(1)  # NORMAL
    for ch in "abcdefghijklmnopqrstuvwxyz.,!?'":
        for piece in (ch, "\u2581" + ch):
            if piece not in seen:
                seen.add(piece)
                tokens.append(piece.encode())
                types.append(1)
    scores = [0.0] * 5 + [-1000.0] * 256 + [-float(i) for i in range(len(tokens) - 261)]
    if fim:  # at the end, so that the other tokens keep their ids
        tokens.extend(FIM_TOKENS)
        types.extend([3] * len(FIM_TOKENS))  # CONTROL
        scores.extend([0.0] * len(FIM_TOKENS))
    if reasoning:
        tokens.extend(REASONING_TOKENS)
        types.extend([4] * len(REASONING_TOKENS))  # USER_DEFINED
        scores.extend([0.0] * len(REASONING_TOKENS))
    return tokens, scores, types


def write_tiny_model(path: Path, *, n_embd: int = 256, n_layer: int = 4, n_ff: int = 512,
                     n_head: int = 4, n_head_kv: int = 4, n_ctx_train: int = 4096,
                     seed: int = 1, q8: bool = False, fim: bool = False,
                     reasoning: bool = False) -> Path:
    """Q8_0 weight matrices (`q8`) go through the buffers a CUDA build's memory pool grows at
    run time: that is where a runtime OOM happens on a real GPU. `fim` adds fill-in-the-middle
    tokens (see FIM_TOKENS); `reasoning`, a reasoning model's template and its think tokens
    (see QWEN35_TEMPLATE)."""
    rng = np.random.default_rng(seed)
    tokens, scores, types = vocabulary(fim, reasoning)
    n_vocab = len(tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("spillway-tiny-test")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if q8 else gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(QWEN35_TEMPLATE.read_text() if reasoning else CHATML)
    if fim:
        first = len(tokens) - len(FIM_TOKENS) - (len(REASONING_TOKENS) if reasoning else 0)
        for i, key in enumerate((gguf.Keys.Tokenizer.FIM_PRE_ID, gguf.Keys.Tokenizer.FIM_SUF_ID,
                                 gguf.Keys.Tokenizer.FIM_MID_ID)):
            w.add_uint32(key, first + i)

    def tensor(name: str, *shape: int, scale: float = 0.05) -> None:
        data = (rng.standard_normal(shape) * scale).astype(np.float32)
        if q8 and len(shape) == 2 and shape[1] % 32 == 0:
            quantized = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, data)

    tensor("token_embd.weight", n_vocab, n_embd)
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    tensor("output.weight", n_vocab, n_embd)
    head_dim = n_embd // n_head
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        tensor(f"blk.{i}.attn_q.weight", n_embd, n_embd)
        tensor(f"blk.{i}.attn_k.weight", n_head_kv * head_dim, n_embd)
        tensor(f"blk.{i}.attn_v.weight", n_head_kv * head_dim, n_embd)
        tensor(f"blk.{i}.attn_output.weight", n_embd, n_embd)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        tensor(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        tensor(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        tensor(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("path", type=Path)
    parser.add_argument("--n-ctx-train", type=int, default=4096)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-ff", type=int, default=512)
    parser.add_argument("--q8", action="store_true", help="Q8_0 weight matrices")
    parser.add_argument("--fim", action="store_true", help="fill-in-the-middle tokens")
    parser.add_argument("--reasoning", action="store_true",
                        help="a reasoning template (Qwen3.5's) and its think tokens")
    a = parser.parse_args()
    print(write_tiny_model(a.path, n_ctx_train=a.n_ctx_train, n_embd=a.n_embd,
                           n_layer=a.n_layer, n_ff=a.n_ff, q8=a.q8, fim=a.fim,
                           reasoning=a.reasoning))
