"""`spillway init`'s mapping from a llama-server command line to a config plan (cmdline.py): where
each flag and variable lands, what Spillway takes over, what is explained instead. Pure: the
cache and key-file lookups are stand-ins here."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from supervisor.commands.init import cmdline, hfcache
from supervisor.commands.init.source import EnvVar, InitError, Source


def no_hf(repo: str, hf_file: str | None, env: Mapping[str, str],
          home: str) -> hfcache.HfModel:
    raise AssertionError("no -hf here")


def keys_file(path: str) -> list[str]:
    assert path == "/cwd/keys.txt"
    return ["first-key-0123", "second-key-0123"]


LOOKUPS = cmdline.Lookups(hf_model=no_hf, read_keys=keys_file)


def plan(*argv: str, env: Mapping[str, str] | None = None,
         options: cmdline.Options | None = None) -> cmdline.Plan:
    source = Source(argv=("llama-server", *argv), where="on the command line",
                    env=tuple(EnvVar(k, v, "in Environment= in /u.service")
                              for k, v in (env or {}).items()),
                    workdir="/cwd", home="/home/u")
    return cmdline.make_plan(source, LOOKUPS, options)


def tokens(lines: list[cmdline.ArgLine]) -> list[str]:
    return [t for line in lines for t in line.tokens]


@pytest.mark.parametrize("gpu", [
    ["-ngl", "40"], ["--n-gpu-layers", "40"], ["--gpu-layers", "all"], ["-ts", "3,1"],
    ["-sm", "row"], ["-fit", "on"], ["-ot", "exps=CPU"], ["-cmoe"], ["-ncmoe", "8"],
    ["-nkvo"], ["--no-kv-offload"], ["-kvo"], ["-ngld", "99"], ["-devd", "CUDA0"],
    ["--device", "Vulkan0"], ["--no-host"], ["-fitt", "512"],
])
def test_gpu_only_flags_go_to_the_gpu_child_alone(gpu: list[str]) -> None:
    p = plan("-m", "/m.gguf", "-c", "4096", *gpu)
    assert tokens(p.model_args) == ["-c", "4096"]
    assert gpu[0] in tokens(p.gpu_args)


@pytest.mark.parametrize("shared", [
    ["-c", "4096"], ["--ctx-size", "4096"], ["-np", "4"], ["-fa", "on"], ["-t", "8"],
    ["--jinja"], ["-ctk", "q8_0"], ["--mlock"], ["--temp", "0.6"], ["--metrics"],
    ["--chat-template-kwargs", '{"enable_thinking": false}'], ["--no-mmap"],
])
def test_other_flags_go_to_both_children(shared: list[str]) -> None:
    p = plan("-m", "/m.gguf", *shared)
    assert tokens(p.model_args) == shared
    assert tokens(p.gpu_args) == ["-ngl", "99"]


def test_spellings_as_llama_server_reads_them() -> None:
    p = plan("--model=/m.gguf", "--ctx_size", "4096", "--n_gpu_layers=20")
    assert p.model_path is not None and p.model_path.value == "/m.gguf"
    assert tokens(p.model_args) == ["--ctx-size", "4096"]
    assert tokens(p.gpu_args) == ["--n-gpu-layers", "20"]


def test_relative_paths_are_made_absolute_against_the_folder_it_ran_in() -> None:
    p = plan("-m", "models/m.gguf", "--mmproj", "~/mm.gguf", "--chat-template-file", "t.jinja",
             "-a", "relative/name")
    assert p.model_path is not None and p.model_path.value == "/cwd/models/m.gguf"
    assert tokens(p.model_args) == ["--mmproj", "/home/u/mm.gguf", "--chat-template-file",
                                    "/cwd/t.jinja", "-a", "relative/name"]
    assert "made absolute" in p.model_args[0].comment


def test_llama_variables_become_flags_and_the_command_line_wins() -> None:
    p = plan("-m", "/m.gguf", "-c", "8192", env={
        "LLAMA_ARG_CTX_SIZE": "4096", "LLAMA_ARG_N_GPU_LAYERS": "30", "LLAMA_ARG_JINJA": "true",
        "LLAMA_ARG_ENDPOINT_METRICS": "no"})
    assert tokens(p.model_args) == ["--jinja", "-c", "8192"]
    assert p.model_args[0].comment == "from LLAMA_ARG_JINJA=true in Environment= in /u.service"
    assert tokens(p.gpu_args) == ["-ngl", "30"]
    assert any(n.startswith("LLAMA_ARG_CTX_SIZE=4096 in Environment= in /u.service: the "
                            "command line gives -c too") for n in p.not_carried)
    assert any(n.startswith("LLAMA_ARG_ENDPOINT_METRICS=no") and "ignores it" in n
               for n in p.not_carried)


def test_owned_variables_are_taken_over_like_their_flags() -> None:
    p = plan(env={"LLAMA_ARG_MODEL": "/m.gguf", "LLAMA_ARG_HOST": "0.0.0.0",
                  "LLAMA_ARG_PORT": "9000", "LLAMA_API_KEY": "sk-env-key-0123"})
    assert p.model_path is not None and p.model_path.value == "/m.gguf"
    assert p.listen.value == "0.0.0.0:9000"
    assert p.secrets == {"SPILLWAY_API_KEY": "sk-env-key-0123"}
    assert p.api_key_env is not None
    assert p.api_key_env.comment == "from LLAMA_API_KEY in Environment= in /u.service"
    assert not p.model_args


def test_other_variables_by_kind() -> None:
    p = plan("-m", "/m.gguf", env={
        "GGML_CUDA_ENABLE_UNIFIED_MEMORY": "1", "HIP_VISIBLE_DEVICES": "0",
        "HF_TOKEN": "hf_secret", "MY_SERVICE_PASSWORD": "pw", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert list(p.env) == ["GGML_CUDA_ENABLE_UNIFIED_MEMORY"]  # both children
    assert list(p.gpu_env) == ["HIP_VISIBLE_DEVICES"]  # the GPU child alone
    assert p.secrets == {"HF_TOKEN": "hf_secret", "MY_SERVICE_PASSWORD": "pw"}
    assert any(n.startswith("CUDA_DEVICE_ORDER=PCI_BUS_ID") for n in p.not_carried)


@pytest.mark.parametrize("argv, env, device", [
    (["-dev", "CUDA1"], {}, 1),
    (["-sm", "none", "-mg", "2"], {}, 2),  # one card: the main GPU, alone
    (["-sm", "none"], {}, 0),  # -mg's default
    ([], {"CUDA_VISIBLE_DEVICES": "3"}, 3),
    (["-sm", "none", "-mg", "1"], {"CUDA_VISIBLE_DEVICES": "2,3"}, 3),
    ([], {"CUDA_VISIBLE_DEVICES": "GPU-8d1c0f3e-1111-2222-3333-444455556666"},
     "GPU-8d1c0f3e-1111-2222-3333-444455556666"),
    (["-dev", "CUDA0,CUDA1", "-sm", "none", "-mg", "1"], {}, 1),  # -mg counts -dev's list
])
def test_the_card_becomes_gpu_device(argv: list[str], env: dict[str, str],
                                     device: int | str) -> None:
    p = plan("-m", "/m.gguf", *argv, env=env)
    assert p.gpu_device is not None and p.gpu_device.value == device
    assert "-dev" not in tokens(p.gpu_args) and "-mg" not in tokens(p.gpu_args)
    assert "CUDA_VISIBLE_DEVICES" not in p.env and "CUDA_VISIBLE_DEVICES" not in p.gpu_env
    assert not p.warnings


@pytest.mark.parametrize("argv, env, device, gpu_args", [
    # Issue 37: a split over two cards, as a two-card user runs llama-server today.
    (["-ts", "1,1"], {}, None, ["-ts", "1,1"]),
    (["-dev", "CUDA0,CUDA1"], {}, "0,1", []),
    (["-dev", "CUDA2,CUDA0", "-ts", "3,1"], {}, "2,0", ["-ts", "3,1"]),  # -dev's order kept
    (["-dev", "CUDA0,CUDA1"], {"CUDA_VISIBLE_DEVICES": "2,3"}, "2,3", []),
    ([], {"CUDA_VISIBLE_DEVICES": "0,1"}, "0,1", []),
    # -mg without -sm none: llama.cpp splits the layers over every card all the same
    (["-mg", "1"], {}, None, ["-mg", "1"]),
    (["-sm", "row", "-mg", "1"], {"CUDA_VISIBLE_DEVICES": "2,3"}, "2,3",
     ["-sm", "row", "-mg", "1"]),
    (["-dev", "CUDA0,CUDA1", "-mg", "1"], {}, "0,1", ["-mg", "1"]),
])
def test_a_split_over_several_cards_gives_the_gpu_child_all_of_them(
        argv: list[str], env: dict[str, str], device: str | None, gpu_args: list[str]) -> None:
    p = plan("-m", "/m.gguf", "-ngl", "99", *argv, env=env)
    assert (p.gpu_device.value if p.gpu_device else None) == device
    assert tokens(p.gpu_args) == ["-ngl", "99", *gpu_args]
    assert not p.warnings, p.warnings


def test_several_cards_say_how_the_gpu_child_numbers_them() -> None:
    p = plan("-m", "/m.gguf", "-dev", "CUDA0,CUDA1", "-ts", "1,1")
    assert p.gpu_device is not None
    assert p.gpu_device.comment.startswith("from -dev CUDA0,CUDA1 on the command line: the "
                                           "cards the GPU child sees (as CUDA0 and CUDA1")


def test_a_card_the_list_does_not_have_is_refused() -> None:
    with pytest.raises(InitError, match="card 2 of 2 visible"):
        plan("-m", "/m.gguf", "-dev", "CUDA2", env={"CUDA_VISIBLE_DEVICES": "0,1"})
    with pytest.raises(InitError,
                       match="the main GPU is device 2 of the 2 that -dev CUDA0,CUDA1 names"):
        plan("-m", "/m.gguf", "-dev", "CUDA0,CUDA1", "-sm", "none", "-mg", "2")


def test_other_backends_devices_stay_as_given() -> None:
    """A Vulkan or ROCm -dev numbers devices in its own order: -sm none's -mg counts those."""
    p = plan("-m", "/m.gguf", "-dev", "Vulkan1,Vulkan0", "-sm", "none", "-mg", "1")
    assert p.gpu_device is None
    assert tokens(p.gpu_args) == ["-ngl", "99", "-dev", "Vulkan1,Vulkan0", "-sm", "none",
                                  "-mg", "1"]


def test_no_card_named_leaves_gpu_device_to_its_default() -> None:
    assert plan("-m", "/m.gguf").gpu_device is None


@pytest.mark.parametrize("argv, listen", [
    ([], "127.0.0.1:8080"),  # llama-server's default
    (["--port", "9000"], "127.0.0.1:9000"),
    (["--host", "::1"], "[::1]:8080"),
    (["--host", "localhost", "--port", "1234"], "localhost:1234"),
    (["--host", "127.0.0.1,::1"], ["127.0.0.1:8080", "[::1]:8080"]),
    (["--host", "/run/llama.sock"], "127.0.0.1:8080"),  # TCP only: said in a warning
])
def test_the_listen_address_is_where_clients_connected(argv: list[str],
                                                       listen: str | list[str]) -> None:
    assert plan("-m", "/m.gguf", *argv).listen.value == listen


def test_default_address_says_so() -> None:
    assert plan("-m", "/m.gguf").listen.comment == (
        "from llama-server's default address (no --host or --port on the command line): "
        "clients keep their URL")


def test_keys_first_of_several_with_a_warning() -> None:
    p = plan("-m", "/m.gguf", "--api-key", "key-one-0123,key-two-0123")
    assert p.secrets == {"SPILLWAY_API_KEY": "key-one-0123"}
    assert any("2 API keys" in w for w in p.warnings)
    p = plan("-m", "/m.gguf", "--api-key-file", "keys.txt", "--host", "0.0.0.0")
    assert p.secrets == {"SPILLWAY_API_KEY": "first-key-0123"}
    assert p.listen.value == "0.0.0.0:8080"


def test_no_secret_value_in_any_comment() -> None:
    p = plan("-m", "/m.gguf", "--api-key", "sk-very-secret", "-hft", "hf_very_secret",
             env={"LLAMA_API_KEY": "sk-env-secret"})
    text = repr(p.__dict__ | {"secrets": None})
    for secret in ("sk-very-secret", "hf_very_secret", "sk-env-secret"):
        assert secret not in text
    assert p.secrets["HF_TOKEN"] == "hf_very_secret"


def test_explicit_public_listen_without_a_key_is_refused() -> None:
    with pytest.raises(InitError, match="only with an API key"):
        plan("-m", "/m.gguf", options=cmdline.Options(listen="0.0.0.0:8080"))
    p = plan("-m", "/m.gguf", options=cmdline.Options(listen="0.0.0.0:8080", new_key="k" * 32))
    assert p.listen.value == "0.0.0.0:8080" and p.secrets == {"SPILLWAY_API_KEY": "k" * 32}


def test_router_flags_and_autoload() -> None:
    p = plan("--models-preset", "presets.ini", "--models-max", "1", "--models-autoload",
             "-ngl", "99")
    assert p.router
    assert tokens(p.model_args) == ["--models-preset", "/cwd/presets.ini", "--models-max", "1"]
    assert any(n.startswith("--models-autoload on the command line: Spillway loads each "
                            "model itself") for n in p.not_carried)


def test_the_last_of_a_repeated_owned_flag_wins_as_in_llama_server() -> None:
    p = plan("-m", "/a.gguf", "-m", "/b.gguf")
    assert p.model_path is not None and p.model_path.value == "/b.gguf"
    assert any(n.startswith("-m /a.gguf on the command line: -m /b.gguf") for n in p.not_carried)


def test_hf_draft_is_the_cached_file() -> None:
    def cached(repo: str, hf_file: str | None, env: Mapping[str, str],
               home: str) -> hfcache.HfModel:
        assert (repo, hf_file, env, home) == ("ggml-org/draft-GGUF", None, {"LLAMA_CACHE": "/c"},
                                              "/home/u")
        return hfcache.HfModel("/c/draft-Q8_0.gguf", None)

    source = Source(argv=("llama-server", "-m", "/m.gguf", "-hfd", "ggml-org/draft-GGUF"),
                    where="on the command line", env=(EnvVar("LLAMA_CACHE", "/c", "x"),),
                    home="/home/u")
    p = cmdline.make_plan(source, cmdline.Lookups(hf_model=cached, read_keys=keys_file))
    assert tokens(p.model_args) == ["-md", "/c/draft-Q8_0.gguf"]


def test_hf_with_m_keeps_m_and_explains() -> None:
    p = plan("-m", "/m.gguf", "-hf", "ggml-org/x-GGUF")
    assert p.model_path is not None and p.model_path.value == "/m.gguf"
    assert any(n.startswith("-hf ggml-org/x-GGUF on the command line: -m names the model")
               for n in p.not_carried)


@pytest.mark.parametrize("argv, message", [
    (["-m", "/m.gguf", "--jinja", "stray"], "'stray' after --jinja"),
    (["-m", "/m.gguf", "-c", "4096", "8192"], "'8192' after -c"),
    (["--version"], "prints something and exits"),
    (["-dr", "ai/gemma3"], "download nothing"),
])
def test_command_lines_llama_server_would_refuse(argv: list[str], message: str) -> None:
    with pytest.raises(InitError, match=message):
        plan(*argv)


def test_a_flag_llama_server_does_not_know_is_carried_with_a_warning() -> None:
    # "llama-server -ctx 8192 -n 1024 -np 2" (server README, router mode): -ctx is no flag
    p = plan("-ctx", "8192", "-n", "1024", "-np", "2")
    assert tokens(p.model_args) == ["-ctx", "8192", "-n", "1024", "-np", "2"]
    assert "not a flag llama-server (llama.cpp 11434) knows" in p.model_args[0].comment
    assert p.model_args[1].comment == ""
    assert any(w.startswith("-ctx 8192 on the command line: not a flag") for w in p.warnings)
    with pytest.raises(InitError, match="no positional arguments"):
        plan("-m", "/m.gguf", "--")


def test_wrappers_are_refused() -> None:
    source = Source(argv=("docker", "run", "img", "-m", "/m"), where="on the command line")
    with pytest.raises(InitError, match="through docker"):
        cmdline.make_plan(source, LOOKUPS)


def test_on_a_cpu_with_amx_the_cpu_child_gets_no_repack() -> None:
    """llama.cpp#20824: the CPU child, the safety net, keeps its weights out of AMX buffers
    on a CPU that has AMX; nowhere else, and not twice."""
    amx = cmdline.Options(cpu_has_amx=True)
    p = plan("-m", "/m/q.gguf", options=amx)
    assert tokens(p.cpu_args) == ["--no-repack"]
    assert "issues/20824" in p.cpu_args[0].comment
    assert any("AMX" in w for w in p.warnings)
    assert plan("-m", "/m/q.gguf").cpu_args == []  # no AMX: nothing added
    assert plan("-m", "/m/q.gguf", "-nr", options=amx).cpu_args == []  # given for both
    assert plan("-m", "/m/q.gguf", "--no-repack", options=amx).cpu_args == []


def test_the_rendered_cpu_args_carry_no_repack_into_the_cpu_childs_command() -> None:
    import tomllib

    from supervisor.config import schema as config
    from supervisor.commands.init import render

    text = render.render(plan("-m", "/m/q.gguf", options=cmdline.Options(cpu_has_amx=True)),
                         None)
    assert "issues/20824" in text  # the reason is in the file, beside the flag
    cfg = config.build(tomllib.loads(text), environ={}, check_paths=False)
    assert "--no-repack" in cfg.child("cpu").command(1, "k")
    assert "--no-repack" not in cfg.child("gpu").command(1, "k")


def test_small_beside_the_gpu_child() -> None:
    small = cmdline.Options(small="/m/small.gguf")
    p = plan("-m", "/m/q.gguf", "-c", "4096", "--alias", "big", "-md", "/m/draft.gguf",
             "-dev", "CUDA1", "-ngl", "40", options=small)
    assert p.small is not None
    assert p.small.path.value == "/m/small.gguf"
    assert (p.small.mode.value, p.small.requests.value) == ("resident", "opt-in")
    # -dev CUDA1 is gpu.device, which the small child's card follows: no -dev of its own;
    # -ngl 40 is the large model's, not the small one's
    assert p.small.args == []
    assert [line.tokens for line in p.small.left_out] == [("--alias", "big"),
                                                           ("-md", "/m/draft.gguf")]
    assert plan("-m", "/m/q.gguf").small is None
    p = plan("-m", "/m/q.gguf", "--device", "ROCm1",
             options=cmdline.Options(small="/home/u/s.gguf", small_mode="on-demand",
                                     small_requests="all"))
    assert p.small is not None
    assert tokens(p.small.args) == ["--device", "ROCm1"]
    assert (p.small.mode.value, p.small.requests.value) == ("on-demand", "all")
    assert p.small.mode.comment.startswith("from --small-mode given to spillway init")
    assert any(w.startswith("/home/u/s.gguf: the shipped systemd unit") for w in p.warnings)


def test_small_needs_a_model_and_its_options_need_small() -> None:
    with pytest.raises(InitError, match="single-model mode"):
        plan("--models-dir", "/m", options=cmdline.Options(small="/m/s.gguf"))
    with pytest.raises(InitError, match="give --small FILE too"):
        plan("-m", "/m/q.gguf", options=cmdline.Options(small_requests="all"))
