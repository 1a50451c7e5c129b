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
    """Four seeds that share no validation, read at 2k tokens (the shortest one's end): x-s3,
    validated at 1k and 4k, is read on the line between them (not at 1k under the 2k label);
    x-s4 validated only at 4k, so it has no value at 2k."""
    write_run(tmp_path, "x-s1", seed=1, losses=[3.0] * 2, vals={2: 2.5})
    write_run(tmp_path, "x-s2", seed=2, losses=[3.0] * 4, vals={2: 2.7, 4: 2.0})
    write_run(tmp_path, "x-s3", seed=3, losses=[3.0] * 4, vals={1: 2.9, 4: 2.0})
    write_run(tmp_path, "x-s4", seed=4, losses=[3.0] * 4, vals={4: 2.0})
    (group,) = seed_groups([summarize_run(f"x-s{i}", tmp_path / f"x-s{i}") for i in range(1, 5)])
    assert group.at_tokens == 2000 and group.val_losses == pytest.approx([2.5, 2.7, 2.6])
    assert group.interpolated
    assert group.n == 3 and group.mean_val_loss == pytest.approx(2.6)
    assert group.left_out == ["x-s4 (no validation by 2,000 tokens)"]
    code, out, err = run_report(capsys, str(tmp_path))
    assert code == 0, err
    assert (
        "at 2,000 tokens (interpolated: the seeds share no validation)  (n=3, seeds 1,2,3,4:" in out
    )
    assert "left out of the statistics: x-s4 (no validation by 2,000 tokens)" in out


def test_seeds_that_stopped_off_the_grid_are_read_where_all_validated(tmp_path: Path) -> None:
    """Seeds validated every 300 steps, one stopped (and validated) at 615 by a budget and one
    at 630: both are read at 600, where each has a validation, not one at 600 and one at 615."""
    grid = {300: 3.0, 600: 2.5}
    write_run(tmp_path, "b-s1", seed=1, losses=[3.0] * 615, vals={**grid, 615: 2.4})
    write_run(tmp_path, "b-s2", seed=2, losses=[3.0] * 630, vals={300: 3.1, 600: 2.7, 630: 1.0})
    (group,) = seed_groups([summarize_run(n, tmp_path / n) for n in ("b-s1", "b-s2")])
    assert group.at_tokens == 600_000 and not group.interpolated
    assert group.val_losses == [2.5, 2.7] and group.left_out == []


def test_groups_off_each_others_grid_are_compared_where_every_run_validated(
    tmp_path: Path, capsys
) -> None:
    """One group ran to 30.7k tokens (validations at 15.4k and 30.7k), the other stopped at
    29.7k by a token budget (validations at 15.4k and 29.7k). The comparison reads every run at
    15,360, and says so; reading the first group at 15.4k under the label 29.7k made it look
    0.2 worse."""
    for seed, (mid, end) in ((1, (6.30, 6.14)), (2, (6.31, 6.13))):
        write_run(tmp_path, f"full-s{seed}", seed=seed, losses=[7.0] * 60, vals={30: mid, 60: end},
                  tokens_per_step=512)  # fmt: skip
        write_run(tmp_path, f"cap-s{seed}", seed=seed, lr=0.001, losses=[7.0] * 58,
                  vals={30: mid + 0.001, 58: end + 0.002}, tokens_per_step=512)  # fmt: skip
    code, out, err = run_report(capsys, str(tmp_path), "--json")
    assert code == 0, err
    (c,) = json.loads(out)["comparisons"]
    assert c["at_tokens"] == 15_360 and not c["interpolated"]
    assert c["difference"] == pytest.approx(0.001 if c["a"] == "lr=0.001" else -0.001)
    assert "(at 15,360 tokens, the most where every run of both validated)" in c["sentence"]
    code, out, err = run_report(capsys, str(tmp_path))
    assert "lr=0.001: 6.1370 ± " in out and " at 29,696 tokens  (n=2" in out
    assert "lr=0.003: 6.1350 ± " in out and " at 30,720 tokens  (n=2" in out


def test_groups_that_share_no_validation_are_compared_between_validations(
    tmp_path: Path, capsys
) -> None:
    """Validations every 3k tokens against every 2k, to 6k and 4k: no count every run has (6k is
    past the shorter end), so each is read at 4k, the long runs on the line from 3k to 6k."""
    for seed, shift in ((1, 0.0), (2, 0.1)):
        write_run(tmp_path, f"a-s{seed}", seed=seed, losses=[3.0] * 6,
                  vals={3: 2.0 + shift, 6: 1.4 + shift})  # fmt: skip
        write_run(tmp_path, f"b-s{seed}", seed=seed, lr=0.001, losses=[3.0] * 4,
                  vals={2: 2.5 + shift, 4: 2.0 + shift})  # fmt: skip
    code, out, err = run_report(capsys, str(tmp_path), "--json")
    assert code == 0, err
    (c,) = json.loads(out)["comparisons"]
    assert c["at_tokens"] == 4000 and c["interpolated"]
    assert abs(c["difference"]) == pytest.approx(0.2)  # a reads 1.8 and 1.9 at 4k; b 2.0, 2.1
    assert "(at 4,000 tokens, interpolated: no count has a validation of every run" in c["sentence"]


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


def test_finding_and_grouping_runs_grows_linearly_with_their_number(
    tmp_path: Path, monkeypatch
) -> None:
    """300 / 1000 / 2000 runs took 2.3 / 9.9 / 38 s: every run was checked against every kept
    one, and every run's keys were the union of all runs' keys, rebuilt per run. Counted, not
    timed: the folders compared while finding runs and the config-key sets joined while
    grouping them, for 300 and for 1,500 runs (5x the runs must stay well under 25x the work)."""
    import builtins

    import nanolab.report.groups as groups
    import nanolab.runs as runs_module
    from nanolab.report.groups import by_config
    from nanolab.runs import RunSummary, discover_runs

    work = {"compared": 0, "joined": 0}

    def counting_any(items) -> bool:
        for item in items:
            work["compared"] += 1
            if item:
                return True
        return False

    class CountingSet(set):
        def union(self, *others):
            work["joined"] += len(others)
            return builtins.set.union(self, *others)

    monkeypatch.setattr(runs_module, "any", counting_any, raising=False)
    monkeypatch.setattr(groups, "set", CountingSet, raising=False)

    def cost(n: int) -> dict[str, int]:
        root = tmp_path / str(n)
        for i in range(n):
            (root / f"r{i}").mkdir(parents=True, exist_ok=True)
            (root / f"r{i}" / "metrics.jsonl").write_text("")
        config = {"model": {"n_layer": 2}, "data": {"d": 1}, "trainer": {"max_steps": 9}}
        runs = [
            RunSummary(run=f"r{i}", status="", group=json.dumps({**config, "x": {"k": i % 7}}))
            for i in range(n)
        ]
        work.update(compared=0, joined=0)
        assert len(discover_runs([root])) == n
        assert len(by_config(runs)) == 7
        return dict(work)

    small, large = cost(300), cost(1500)
    assert small["compared"] > 0 and small["joined"] > 0  # the counters see the work
    for kind in work:
        assert large[kind] < 8 * small[kind], (kind, small, large)


def test_compare_reads_its_two_runs_and_their_groups_not_a_long_run_beside_them(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """A 2M-step run lying beside A and B made a 1.3 s compare take 292 s: every run under the
    root was summarised for the seed groups, and A and B were read three times. The other runs
    now place A and B in their groups by their config alone, read from the end of their logs."""
    import nanolab.runlog as runlog

    for seed, val in ((1, 2.5), (2, 2.6)):
        write_run(tmp_path, f"x-s{seed}", seed=seed, losses=[3.0], vals={1: val})
        write_run(tmp_path, f"y-s{seed}", seed=seed, lr=0.001, losses=[3.0], vals={1: val + 0.2})
    long = write_run(tmp_path, "long", seed=1, lr=0.01, losses=[3.0], vals={1: 2.0}, end=None)
    train = json.dumps({"event": "train", "time": 1.0, "step": 2, "loss": 2.0, "tokens": 9})
    with open(long / "metrics.jsonl", "a") as f:
        f.write((train + "\n") * 50_000)
    parsed = []
    real = runlog._parse
    monkeypatch.setattr(runlog, "_parse", lambda line: parsed.append(1) or real(line))
    code, out, err = run_report(capsys, str(tmp_path), "--compare", "x-s1", "y-s1")
    assert code == 0, err
    assert "seed groups: lr=0.001" in out or "seed groups: lr=0.003" in out
    assert len(parsed) < 200, len(parsed)  # the four seeds' few lines and five start records


FORK = """
from nanolab.training.module import GPTLightningModule


class SmoothedGPT(GPTLightningModule):
    def __init__(self, *args, label_smoothing: float = 0.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.label_smoothing = label_smoothing
"""


def test_runs_of_a_class_path_model_are_a_group_of_their_own_on_the_same_data(
    tmp_path: Path, char_dataset: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fork's model named by class path (``--model pkg.SmoothedGPT``, logged as
    ``model.class_path`` + ``model.init_args``) beside plain runs on the same data: two seed
    groups told apart by the class and n_layer (they were one group of four, "seeds ran more
    than once"), on one data (they were "on other data"), and --compare names only what
    differs (every model key was "(unset)" on one side)."""
    import sys

    from conftest import nanolab_here, tiny_overrides, write_config

    (tmp_path / "nanolab_report_fork.py").write_text(FORK)
    monkeypatch.syspath_prepend(str(tmp_path))
    runs = tmp_path / "runs"
    tiny = write_config(
        tmp_path / "tiny.yaml",
        tiny_overrides(char_dataset, runs, trainer__max_steps=2, run__eval_every_steps=2),
    )
    fork = ["--model", "nanolab_report_fork.SmoothedGPT", "--model.label_smoothing", "0.3",
            "--model.gpt.n_layer", "1"]  # fmt: skip
    try:
        for seed in (1, 2):
            for name, extra in (("base", []), ("sm", fork)):
                done = nanolab_here("-q", "fit", "--config", str(tiny), "--seed_everything",
                                    str(seed), "--run.name", f"{name}-s{seed}", *extra,
                                    cwd=tmp_path)  # fmt: skip
                assert done.returncode == 0, done.stderr[-2000:]
    finally:
        sys.modules.pop("nanolab_report_fork", None)
    names = ("base-s1", "base-s2", "sm-s1", "sm-s2")
    summaries = [summarize_run(n, runs / n) for n in names]
    assert sorted((g.label, tuple(g.runs)) for g in seed_groups(summaries)) == [
        ("model=GPTLightningModule, n_layer=2", ("base-s1", "base-s2")),
        ("model=SmoothedGPT, n_layer=1", ("sm-s1", "sm-s2")),
    ]
    from nanolab.report import data_key

    assert len({data_key(s) for s in summaries}) == 1  # one data, one vocabulary
    code, out, err = run_report(capsys, str(runs), "--compare", "base-s1", "sm-s1")
    assert code == 0, err
    table = out.split("\n\n")[0].splitlines()
    assert [row.split()[0] for row in table[1:]] == [
        "model.class_path", "model.gpt.n_layer", "model.label_smoothing", "run.name"
    ]  # fmt: skip
    assert table[1].split()[1:] == [
        "nanolab.training.module.GPTLightningModule",
        "nanolab_report_fork.SmoothedGPT",
    ]


@pytest.mark.parametrize(("short", "long"), [("bf16", "bf16-mixed"), ("16", "16-mixed"),
                                             ("32", "32-true"), (None, "32-true")])  # fmt: skip
def test_a_precision_spelled_short_is_one_group_with_its_lightning_name(
    tmp_path: Path, short, long
) -> None:
    """``trainer.precision: bf16`` is Lightning's ``bf16-mixed`` (``16``: ``16-mixed``, ``32``
    and null: ``32-true``): two seeds launched with the two spellings are one seed group in
    the plain report, as they are one recipe in ``--scaling``, not two configs of one run each.

    Mutations caught: the plain report's groups comparing the precision as written."""

    def precision(value):
        return lambda config: config["trainer"].__setitem__("precision", value)

    for name, seed, value in (("p-s1", 1, short), ("p-s2", 2, long)):
        _edit_config(write_run(tmp_path, name, seed=seed, losses=[3.0], vals={1: 2.5}),
                     precision(value))  # fmt: skip
    (group,) = seed_groups([summarize_run(n, tmp_path / n) for n in ("p-s1", "p-s2")])
    assert group.runs == ["p-s1", "p-s2"]
