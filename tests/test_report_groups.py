"""Seed groups of runs whose configs differ in a key set to null in some of them, and groups
whose seeds did not all validate where the group's figures are taken."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_report import run_report, write_run

from nanolab.report import seed_groups, summarize_run


def _edit_config(run_dir: Path, edit) -> None:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    start = json.loads(lines[0])
    edit(start["config"])
    (run_dir / "metrics.jsonl").write_text("\n".join([json.dumps(start), *lines[1:]]) + "\n")


def _window(value):
    def edit(config: dict) -> None:
        config["model"]["gpt"]["attention_window"] = value
        config["trainer"]["gradient_clip_val"] = None

    return edit


def test_a_key_null_in_some_runs_and_set_in_others_splits_the_groups(tmp_path: Path) -> None:
    for name, seed, window, val in (("w-s1", 1, 8, 2.5), ("w-s2", 2, 8, 2.6),
                                    ("f-s1", 1, None, 2.9), ("f-s2", 2, None, 3.0)):  # fmt: skip
        _edit_config(write_run(tmp_path, name, seed=seed, losses=[3.0], vals={1: val}),
                     _window(window))  # fmt: skip
    summaries = [summarize_run(n, tmp_path / n) for n in ("w-s1", "w-s2", "f-s1", "f-s2")]
    groups = seed_groups(summaries)
    assert [(g.label, g.runs) for g in groups] == [
        ("attention_window=8", ["w-s1", "w-s2"]),
        ("attention_window=None", ["f-s1", "f-s2"]),
    ][:: -1 if groups[0].label > groups[1].label else 1]
    assert {g.label: g.mean_val_loss for g in groups} == pytest.approx(
        {"attention_window=8": 2.55, "attention_window=None": 2.95}
    )


def test_a_null_section_and_a_set_one_are_two_configs(tmp_path: Path) -> None:
    def logger(value):
        return lambda config: config["trainer"].__setitem__("logger", value)

    for name, seed, value in (("a-s1", 1, None), ("a-s2", 2, None),
                              ("b-s1", 1, {"class_path": "CSVLogger"})):  # fmt: skip
        _edit_config(write_run(tmp_path, name, seed=seed, losses=[3.0], vals={1: 2.5}),
                     logger(value))  # fmt: skip
    summaries = [summarize_run(n, tmp_path / n) for n in ("a-s1", "a-s2", "b-s1")]
    (group,) = seed_groups(summaries)
    assert group.runs == ["a-s1", "a-s2"] and group.label == "class_path=None"


def test_a_key_only_some_logs_carry_splits_only_where_those_logs_differ(tmp_path: Path) -> None:
    """An older log without the key is a config of its own when the newer ones disagree on it
    (it cannot be told which of them it trained with); with one value among them, it is not."""
    write_run(tmp_path, "old-s1", seed=1, losses=[3.0], vals={1: 2.0})
    write_run(tmp_path, "old-s2", seed=2, losses=[3.0], vals={1: 2.1})
    for name, seed, window in (("w-s1", 1, 8), ("w-s2", 2, 8), ("f-s1", 1, None)):
        _edit_config(write_run(tmp_path, name, seed=seed, losses=[3.0], vals={1: 2.5}),
                     _window(window))  # fmt: skip
    names = ("old-s1", "old-s2", "w-s1", "w-s2", "f-s1")
    groups = seed_groups([summarize_run(n, tmp_path / n) for n in names])
    assert sorted((g.label, tuple(g.runs)) for g in groups) == [
        ("attention_window unset", ("old-s1", "old-s2")),
        ("attention_window=8", ("w-s1", "w-s2")),
    ]


def test_a_seed_without_a_validation_where_the_group_is_read_is_named_not_counted(
    tmp_path: Path, capsys
) -> None:
    """Four seeds read at 2k tokens (the shortest one's end): one validated only at 4k."""
    write_run(tmp_path, "x-s1", seed=1, losses=[3.0] * 2, vals={2: 2.5})
    write_run(tmp_path, "x-s2", seed=2, losses=[3.0] * 4, vals={2: 2.7, 4: 2.0})
    write_run(tmp_path, "x-s3", seed=3, losses=[3.0] * 4, vals={1: 2.9, 4: 2.0})
    write_run(tmp_path, "x-s4", seed=4, losses=[3.0] * 4, vals={4: 2.0})
    (group,) = seed_groups([summarize_run(f"x-s{i}", tmp_path / f"x-s{i}") for i in range(1, 5)])
    assert group.at_tokens == 2000 and group.val_losses == [2.5, 2.7, 2.9]
    assert group.n == 3 and group.mean_val_loss == pytest.approx(2.7)
    assert group.left_out == ["x-s4 (no validation by 2k tokens)"]
    code, out, err = run_report(capsys, str(tmp_path))
    assert code == 0, err
    assert "(n=3, seeds 1,2,3,4:" in out
    assert "left out of the statistics: x-s4 (no validation by 2k tokens)" in out


def test_compare_says_what_it_cannot_compare_and_refuses_json(tmp_path: Path, capsys) -> None:
    """Run A's group has three seeds; run B's two, one of them diverged: one usable seed."""
    for seed, val in ((1, 2.5), (2, 2.6), (3, 2.55)):
        write_run(tmp_path, f"x-s{seed}", seed=seed, losses=[3.0], vals={1: val})
    write_run(tmp_path, "y-s1", seed=1, lr=0.001, losses=[3.0], vals={1: 2.9})
    write_run(tmp_path, "y-s2", seed=2, lr=0.001, losses=[3.0], vals={1: 2.9}, end="diverged")
    code, out, err = run_report(capsys, str(tmp_path), "--compare", "x-s1", "y-s1")
    assert code == 0, err
    assert "final val loss" in out and "error" not in err
    assert out.rstrip().endswith(
        "seed groups: not compared: lr=0.001 has 1 usable seed(s) (left out: y-s2 (diverged)); "
        "a comparison needs two in each group"
    )
    code, out, err = run_report(capsys, str(tmp_path), "--compare", "x-s1", "y-s1", "--json")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("nanolab report: error: --json: --compare prints text only")
