"""Seed groups with confidence intervals, and differences beyond seed noise, checked against
hand computations (no scipy in the expected values)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from nanolab.report import main
from nanolab.stats import mean_ci, sentence, welch

T_975_DF2 = 4.302652729911275  # Student t quantiles from a printed table
T_975_DF4 = 2.7764451051977934


def t_cdf_df4(t: float) -> float:
    """Student's t CDF for 4 degrees of freedom, in closed form."""
    u = t * t / 4
    return 0.5 + (3 * t / (8 * math.sqrt(1 + u))) * (1 - u / (3 * (1 + u)))


def test_interval_of_a_mean_by_hand() -> None:
    ci = mean_ci([1.0, 1.2, 1.1])
    assert ci.mean == pytest.approx(1.1)
    assert ci.half_width == pytest.approx(T_975_DF2 * 0.1 / math.sqrt(3))
    assert mean_ci([2.0]).half_width is None and "1 seed: no interval" in mean_ci([2.0]).text()


def test_welch_by_hand() -> None:
    """sd 0.1 in both groups of 3: se = sqrt(0.01/3 * 2), Welch's dof = 4, t = 0.3 / se."""
    d = welch([1.0, 1.2, 1.1], [1.3, 1.5, 1.4])
    se = math.sqrt(0.02 / 3)
    assert d.difference == pytest.approx(-0.3)
    assert d.dof == pytest.approx(4.0)
    assert d.half_width == pytest.approx(T_975_DF4 * se)
    assert d.p_value == pytest.approx(2 * (1 - t_cdf_df4(0.3 / se)), rel=1e-9)
    assert d.significant
    text = sentence("lr=0.003", "lr=0.001", d)
    assert (
        text
        == "lr=0.003 is lower than lr=0.001 by 0.300 ± 0.227 val loss (3 seeds each, Welch p = 0.021)"
    )


def test_noise_says_so_and_how_many_seeds_would_tell() -> None:
    """A difference of 0.02 with sd 0.1: not distinguishable; n = 2 (1.96 + 0.8416)^2 0.01 /
    0.02^2 = 392.4 -> 393, plus one for the t tails."""
    d = welch([1.0, 1.2, 1.1], [1.02, 1.22, 1.12])
    assert not d.significant
    assert d.seeds_needed == math.ceil(2 * (1.959964 + 0.841621) ** 2 * 0.01 / 0.02**2) + 1
    assert "not distinguishable from seed noise at 3 seeds each" in sentence("a", "b", d)
    assert f"about {d.seeds_needed} seeds each" in sentence("a", "b", d)


def write_run(root: Path, name: str, lr: float, seed: int, vals: list[tuple[int, float]]) -> None:
    """A finished run's log: start (config), validations (tokens, loss), end."""
    run = root / name
    run.mkdir(parents=True)
    config = {"model": {"optimizer": {"lr": lr}}, "seed_everything": seed}
    records = [{"event": "start", "time": 1.0, "step": 0, "seed": seed, "config": config}]
    records += [
        {"event": "val", "time": 2.0 + i, "step": i + 1, "tokens": t, "val_loss": v}
        for i, (t, v) in enumerate(vals)
    ]
    records.append({"event": "end", "time": 99.0, "step": len(vals), "reason": "completed"})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_report_prints_the_difference_at_equal_tokens(tmp_path: Path, capsys) -> None:
    """Two configs x 3 seeds; one seed of lr=0.001 ran twice as long (a lower loss at 2000
    tokens that the others never reached): everything is compared at 1000 tokens."""
    for seed, (fast, slow) in enumerate([(1.0, 1.3), (1.2, 1.5), (1.1, 1.4)]):
        write_run(tmp_path, f"fast-s{seed}", 0.003, seed, [(500, 2.0), (1000, fast)])
        longer = [(500, 2.1), (1000, slow)] + ([(2000, 0.5)] if seed == 0 else [])
        write_run(tmp_path, f"slow-s{seed}", 0.001, seed, longer)
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "lr=0.003: 1.1000 ± 0.2484" in out  # 4.3027 x 0.1 / sqrt(3)
    assert "lr=0.003 is lower than lr=0.001 by 0.300 ± 0.227 val loss (3 seeds each" in out
    assert main([str(tmp_path), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    (c,) = payload["comparisons"]
    assert (c["a"], c["b"]) == ("lr=0.001", "lr=0.003")  # each against the lowest mean
    assert c["difference"] == pytest.approx(0.3) and c["at_tokens"] == 1000
    assert main([str(tmp_path), "--baseline", "lr=0.003"]) == 0
    assert "lr=0.003 is lower than lr=0.001" in capsys.readouterr().out
    assert main([str(tmp_path), "--baseline", "nope"]) == 2
    assert "--baseline 'nope' is neither" in capsys.readouterr().err
    assert main([str(tmp_path), "--compare", "fast-s0", "slow-s1"]) == 0
    assert "seed groups: lr=0.003 is lower than lr=0.001 by 0.300" in capsys.readouterr().out


def test_index_adds_each_ended_run_once(tmp_path: Path, capsys) -> None:
    """``report --index``: results.log gets one line per ended run it lacks (a run's own end
    line counts), never a second one, and nothing for a run still going."""
    write_run(tmp_path, "a", 0.003, 1, [(1000, 1.5)])
    write_run(tmp_path, "b", 0.001, 1, [(1000, 1.7)])
    live = tmp_path / "live"
    live.mkdir()
    (live / "metrics.jsonl").write_text(
        json.dumps({"event": "start", "time": 9e9, "step": 0}) + "\n"
    )
    own = {"run": "a", "reason": "completed", "step": 1, "run_dir": str(tmp_path / "a")}
    (tmp_path / "results.log").write_text(json.dumps(own) + "\n")  # a's own end line
    assert main([str(tmp_path), "--index"]) == 0
    assert "results.log: 1 run(s) added" in capsys.readouterr().err
    lines = [json.loads(x) for x in (tmp_path / "results.log").read_text().splitlines()]
    assert [x["run"] for x in lines] == ["a", "b"]
    assert lines[1]["val_loss"] == 1.7 and lines[1]["reason"] == "completed"
    assert main([str(tmp_path), "--index"]) == 0
    assert "0 run(s) added" in capsys.readouterr().err


def test_seeds_without_spread_are_said_not_tested() -> None:
    d = welch([3.5, 3.5, 3.5], [3.4, 3.4, 3.4])
    assert math.isnan(d.p_value) and not d.significant
    assert "no spread, so no test" in sentence("a", "b", d)


def test_index_names_runs_not_paths(tmp_path: Path, capsys, monkeypatch) -> None:
    """The same root reached by another path (or copied) adds nothing twice."""
    write_run(tmp_path, "a", 0.003, 1, [(1000, 1.5)])
    monkeypatch.chdir(tmp_path)
    assert main([".", "--index"]) == 0
    monkeypatch.chdir("/")
    assert main([str(tmp_path), "--index"]) == 0
    assert "0 run(s) added" in capsys.readouterr().err
    assert len((tmp_path / "results.log").read_text().splitlines()) == 1


def test_a_seed_that_diverged_is_named_and_left_out_of_the_statistics(
    tmp_path: Path, capsys
) -> None:
    """Three seeds of one config, one of which ended with a NaN val loss: the mean, the
    interval and the comparison are over the two others, and the report says which run was
    left out and why (dropping it silently would flatter the config)."""
    for seed, loss in enumerate([1.0, 1.2]):
        write_run(tmp_path, f"fast-s{seed}", 0.003, seed, [(500, 2.0), (1000, loss)])
    write_run(tmp_path, "fast-s2", 0.003, 2, [(500, 2.0), (1000, float("nan"))])
    for seed, loss in enumerate([1.4, 1.5, 1.3]):
        write_run(tmp_path, f"slow-s{seed}", 0.001, seed, [(500, 2.1), (1000, loss)])
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "lr=0.003: 1.1000 ± " in out and "(n=2, seeds 0,1,2: fast-s0, fast-s1, fast-s2)" in out
    assert "left out of the statistics: fast-s2 (no finite val loss at its end)" in out
    assert "seed noise at 3 and 2 seeds" in out  # the comparison too, over the finite ones


def test_a_run_that_logged_part_of_its_config_stands_alone(tmp_path: Path) -> None:
    """A debug run whose start record held only its ``model`` section cut every run's config
    down to the model keys: unrelated runs (other data, other steps) became one "seed group"
    with a mean and an interval. A run missing a section the others have stands alone."""
    from nanolab.report import seed_groups
    from nanolab.runs import summarize_run

    model = {"optimizer": {"lr": 0.003}}
    configs = {
        "a-s1": {"model": model, "data": {"dataset_dir": "data/a"}, "trainer": {"max_steps": 600}},
        "a-s2": {"model": model, "data": {"dataset_dir": "data/a"}, "trainer": {"max_steps": 600}},
        "b": {"model": model, "data": {"dataset_dir": "data/b"}, "trainer": {"max_steps": 50}},
        "debug": {"model": model},
    }
    for seed, (name, config) in enumerate(configs.items()):
        write_run(tmp_path, name, 0.003, seed, [(500, 2.0 + seed / 10)])
        log = tmp_path / name / "metrics.jsonl"
        lines = log.read_text().splitlines()
        start = json.loads(lines[0])
        start["config"] = {**config, "seed_everything": seed}
        log.write_text("\n".join([json.dumps(start), *lines[1:]]) + "\n")
    summaries = [summarize_run(name, tmp_path / name) for name in configs]
    (group,) = seed_groups(summaries)
    assert sorted(group.runs) == ["a-s1", "a-s2"]


def test_a_longer_group_is_not_the_reference_and_every_pair_is_tested(
    tmp_path: Path, capsys
) -> None:
    """Two learning rates at 1000 tokens beside a group that trained to 2000 tokens (lowest at
    its own end, highest at 1000): the pair of equal length is tested too, and each sentence
    names the seed counts in the order of its names."""
    for seed in range(3):
        write_run(tmp_path, f"long-s{seed}", 0.0006, seed, [(1000, 1.8 + seed / 100), (2000, 0.9)])
    for seed in range(2):
        write_run(tmp_path, f"lr1-s{seed}", 0.001, seed, [(1000, 1.4 + seed / 100)])
        write_run(tmp_path, f"lr3-s{seed}", 0.003, seed, [(1000, 1.1 + seed / 100)])
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "(every pair of the 3 groups; --baseline GROUP tests each against one)" in out
    assert "lr=0.003 is lower than lr=0.001 by 0.300" in out  # the pair run to be compared
    assert "lr=0.003 is lower than lr=0.0006 by 0.705 ± " in out and "(2 and 3 seeds" in out
    assert main([str(tmp_path), "--json"]) == 0
    pairs = [(c["a"], c["b"]) for c in json.loads(capsys.readouterr().out)["comparisons"]]
    assert pairs == [
        ("lr=0.001", "lr=0.003"), ("lr=0.0006", "lr=0.003"), ("lr=0.0006", "lr=0.001")
    ]  # fmt: skip


def test_many_groups_are_each_tested_against_the_lowest_at_shared_tokens(
    tmp_path: Path, capsys
) -> None:
    """Five groups: each against one reference, the lowest at the tokens all reached (not
    the group that trained longest), and the heading says how to pick another."""
    for seed in range(2):
        write_run(tmp_path, f"long-s{seed}", 0.0001, seed, [(1000, 1.9 + seed / 10), (2000, 0.5)])
        for i, lr in enumerate([0.001, 0.002, 0.003, 0.004]):
            write_run(tmp_path, f"g{i}-s{seed}", lr, seed, [(1000, 1.5 - i / 10 + seed / 10)])
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert (
        "(each group against lr=0.004, the lowest val loss at 1,000 tokens, the most all "
        "reached; --baseline GROUP picks another)"
    ) in out
    sentences = out.split("\ndifferences")[1].splitlines()[2:]
    assert len(sentences) == 4 and all("lr=0.004" in line for line in sentences)


def _write_data_run(root: Path, name: str, data: str, vocab: int, lr: float, seed: int,
                    loss: float, bpb: float) -> None:  # fmt: skip
    """A finished run on ``data`` with a ``vocab``-token vocabulary: two validations."""
    run = root / name
    run.mkdir(parents=True)
    config = {"model": {"gpt": {"vocab_size": vocab}, "optimizer": {"lr": lr}},
              "data": {"dataset_dir": data}, "seed_everything": seed}  # fmt: skip
    records = [{"event": "start", "time": 1.0, "step": 0, "seed": seed, "config": config}]
    records += [
        {"event": "val", "time": 2.0 + i, "step": i + 1, "tokens": t, "val_loss": v,
         "val_bpb": v / loss * bpb}
        for i, (t, v) in enumerate([(500, loss + 1.0), (1000, loss)])
    ]  # fmt: skip
    records.append({"event": "end", "time": 99.0, "step": 2, "reason": "completed"})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_groups_on_other_data_or_vocabulary_are_not_ranked_or_tested(tmp_path, capsys) -> None:
    """Two character-level groups and a BPE group: a val loss per BPE token and one per
    character are not one quantity, so the BPE group is neither ranked nor Welch-tested against
    the others (it read "lr=0.001 is lower than bpe by 1.3 ... p = 0.006" while its bits per
    byte said the opposite); one line says why, with the bits per byte side by side, and
    ``--compare`` and ``--baseline`` say the same.

    Mutations caught: compare_groups over every group; the line without its reason."""
    for seed, (a, b, c) in enumerate([(1.0, 1.3, 2.5), (1.2, 1.5, 2.7), (1.1, 1.4, 2.6)]):
        _write_data_run(tmp_path, f"fast-s{seed}", "data/chars", 65, 0.003, seed, a, 1.5)
        _write_data_run(tmp_path, f"slow-s{seed}", "data/chars", 65, 0.001, seed, b, 1.9)
        _write_data_run(tmp_path, f"bpe-s{seed}", "data/bpe", 300, 0.001, seed, c, 1.2)
    assert main([str(tmp_path), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    (c,) = payload["comparisons"]
    assert "data/chars, vocab 65" in c["reference"] and c["difference"] == pytest.approx(0.3)
    (apart,) = payload["not_compared"]
    bpe = next(g["label"] for g in payload["seed_groups"] if "bpe-s0" in g["runs"])
    assert apart["groups"] == [bpe] and apart["data"] == "data/bpe, vocab 300"
    assert apart["others_data"] == "data/chars, vocab 65" and len(apart["others"]) == 2
    assert apart["val_bpb"][bpe] == pytest.approx(1.2)
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("Welch p =") == 1
    assert (f"{bpe} (data/bpe, vocab 300) and " in out and "(data/chars, vocab 65): not "
            "compared, other data and another vocabulary (a val loss is per token of its own "
            f"text and vocabulary); mean val bpb at the runs' last validation: {bpe} 1.2000 vs"
            ) in out  # fmt: skip
    assert main([str(tmp_path), "--compare", "fast-s0", "bpe-s1"]) == 0
    assert "seed groups: " in (out := capsys.readouterr().out) and "not compared, other" in out
    assert "lower than" not in out
    assert main([str(tmp_path), "--baseline", "bpe-s1"]) == 2
    err = capsys.readouterr().err
    assert "no other seed group was trained on its data and vocabulary (data/bpe" in err
    assert len(err.strip().splitlines()) == 1


def test_a_config_too_few_runs_kept_from_a_test_is_said_not_dropped(tmp_path: Path, capsys):
    """One seed of a variant (and a group whose other seed diverged) was no line at all under
    the differences: each is now "not tested", with what it has and the seeds to add, against
    the group it would be tested with; the tested groups keep their ranking and sentence."""
    from test_report import run_report, write_run

    for i, v in enumerate([2.50, 2.52, 2.49], 1):
        write_run(tmp_path, f"a-s{i}", seed=i, losses=[3.0, 2.8], vals={1: 2.9, 2: v})
    for i, v in enumerate([2.70, 2.72], 1):
        write_run(tmp_path, f"c-s{i}", seed=i, lr=0.01, losses=[3.0, 2.8], vals={1: 2.9, 2: v})
    write_run(tmp_path, "b-s1", seed=1, lr=0.001, losses=[3.0, 2.8], vals={1: 2.9, 2: 2.3})
    write_run(tmp_path, "d-s1", seed=1, lr=0.03, losses=[3.0, 2.8], vals={1: 2.9, 2: 2.6})
    write_run(tmp_path, "d-s2", seed=2, lr=0.03, losses=[3.0], vals={1: 9.0}, end="diverged")
    code, out, _ = run_report(capsys, str(tmp_path))
    assert code == 0
    assert "lr=0.003 is lower than lr=0.01 by 0.207" in out
    assert ("lr=0.001 vs lr=0.003: not tested, lr=0.001 has 1 run (b-s1); a test needs two "
            "seeds of each: add seeds (queue add its config --seeds 2,3)") in out  # fmt: skip
    assert "lr=0.03 vs lr=0.003: not tested, lr=0.03 has 1 usable seed of 2 (left out: " in out
    _, out, _ = run_report(capsys, str(tmp_path), "--json", "--baseline", "lr=0.01")
    report = json.loads(out)
    assert [(c["a"], c["b"]) for c in report["comparisons"]] == [("lr=0.003", "lr=0.01")]
    assert sorted((c["group"], c["against"], c["n"]) for c in report["not_tested"]) == [
        ("lr=0.001", "lr=0.01", 1), ("lr=0.03", "lr=0.01", 1)
    ]  # fmt: skip


def test_groups_validated_off_each_others_grid_are_said_not_tested(tmp_path: Path, capsys):
    """Two groups of two seeds whose validations do not overlap (one validated only past the
    other's end): the pair was dropped without a word."""
    from test_report import run_report, write_run

    for i in (1, 2):
        write_run(tmp_path, f"a-s{i}", seed=i, losses=[3.0, 2.8], vals={1: 2.9, 2: 2.5 + i / 100})
        write_run(tmp_path, f"b-s{i}", seed=i, lr=0.01, losses=[3.0, 2.9, 2.8, 2.7],
                  vals={3: 2.6, 4: 2.5 + i / 100})  # fmt: skip
    _, out, _ = run_report(capsys, str(tmp_path))
    assert ("not tested, lr=0.01 has 0 run(s) with a validation at or either side of 2,000 "
            "tokens, the most both reached") in out, out  # fmt: skip


def test_a_baseline_of_a_config_run_once_says_so(tmp_path: Path, capsys) -> None:
    """``--baseline b-s1``, the one run of its config, was "neither a seed group's label nor
    one of its runs": it is a run, of a config run once, and a baseline needs two seeds. The
    line says that and the seeds to add, as the "not tested" line does."""
    from test_report import run_report, write_run

    for i, v in enumerate([2.50, 2.52, 2.49], 1):
        write_run(tmp_path, f"a-s{i}", seed=i, losses=[3.0, 2.8], vals={1: 2.9, 2: v})
    for i, v in enumerate([2.70, 2.72], 1):
        write_run(tmp_path, f"c-s{i}", seed=i, lr=0.01, losses=[3.0, 2.8], vals={1: 2.9, 2: v})
    write_run(tmp_path, "b-s1", seed=1, lr=0.001, losses=[3.0, 2.8], vals={1: 2.9, 2: 2.3})
    write_run(tmp_path, "d-s1", seed=1, lr=0.03, losses=[3.0, 2.8], vals={1: 2.9, 2: 2.6})
    write_run(tmp_path, "d-s2", seed=2, lr=0.03, losses=[3.0], vals={1: 9.0}, end="diverged")
    add = "a baseline needs two seeds of its config: add seeds (queue add its config --seeds"
    for baseline, said in [
        ("b-s1", f"--baseline 'b-s1' is a run of lr=0.001, a config run once; {add} 2,3)"),
        ("lr=0.001", f"--baseline 'lr=0.001' names lr=0.001, a config run once; {add} 2,3)"),
        ("d-s1", "--baseline 'd-s1' is a run of lr=0.03, which has 1 usable seed of 2 (left "),
    ]:
        code, _, err = run_report(capsys, str(tmp_path), "--baseline", baseline)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert said in err and "neither" not in err, err
        assert err.strip().endswith("or name a seed group: lr=0.003; lr=0.01"), err
    code, _, err = run_report(capsys, str(tmp_path), "--baseline", "nope")
    assert code == 2 and "is neither a seed group's label nor one of its runs" in err, err
