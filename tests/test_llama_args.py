"""llama-server argument lists: grouping, aliases, merging."""

from __future__ import annotations

from supervisor.config.llama_args import canonical, find_flag, flag_value, group_args, merge_args


def test_groups_take_the_values_that_follow_and_negative_numbers_are_values() -> None:
    groups = group_args(["-c", "8192", "-n", "-1", "--no-mmap", "--device", "none"])
    assert [g.tokens for g in groups] == [("-c", "8192"), ("-n", "-1"), ("--no-mmap",),
                                          ("--device", "none")]
    assert [g.index for g in groups] == [0, 2, 4, 5]


def test_aliases_share_a_canonical_name() -> None:
    assert canonical("--ctx-size") == canonical("-c") == "-c"
    assert canonical("--n-gpu-layers") == canonical("--gpu-layers") == "-ngl"
    assert canonical("--fit") == "-fit"
    assert canonical("--something-new") == "--something-new"


def test_merge_replaces_a_shared_flag_with_the_childs_own() -> None:
    merged = merge_args(["-c", "8192", "-np", "2", "--device", "CUDA0"],
                        ["--device", "none", "-ngl", "0"])
    assert merged == ["-c", "8192", "-np", "2", "--device", "none", "-ngl", "0"]


def test_flag_value_reads_the_last_given_value() -> None:
    args = ["-c", "4096", "--ctx-size", "8192"]
    assert flag_value(args, "-c") == "8192"
    assert flag_value(args, "-np") is None
    assert find_flag(["--flash-attn"], "-fa") is not None
