"""A newcomer's findings: labels that say what they are, and claims checked against the data."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from test_report_stats import T_975_DF2, write_run

from nanolab import report

BENCHES = Path(__file__).resolve().parents[1] / "benches"


# -- 1. the plot's band is what its title says ------------------------------------------------
def test_plot_band_is_the_t_interval_its_title_names(tmp_path: Path, monkeypatch) -> None:
    """Three seeds at 1.0, 1.2, 1.1: the band is 1.1 ± t(0.975, 2) 0.1 / sqrt(3), never the
    min-max; the figure's title says so, and so does docs/report.md."""
    import matplotlib.figure

    for seed, loss in enumerate([1.0, 1.2, 1.1]):
        write_run(tmp_path, f"r-s{seed}", 0.003, seed, [(500, 2.0 + seed / 10), (1000, loss)])
    titles: list[str] = []
    real_savefig = matplotlib.figure.Figure.savefig

    def savefig(fig, *args, **kwargs):
        titles.append(fig._suptitle.get_text() if fig._suptitle else "")
        return real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    runs = [(report.summarize_run(d.name, d), d) for d in sorted(tmp_path.iterdir())]
    (drawn,) = report.plot_runs(runs, tmp_path / "plot.png", "tokens")
    x, mean, lo, hi = drawn["val_band"][-1]
    half = T_975_DF2 * 0.1 / math.sqrt(3)
    assert (x, mean) == (1000, pytest.approx(1.1))
    assert (lo, hi) == (pytest.approx(1.1 - half), pytest.approx(1.1 + half))
    assert titles == [report.plot.BAND_TITLE] and "95% confidence interval" in titles[0]
    docs = (Path(__file__).parents[1] / "docs" / "report.md").read_text()
    assert "min–max" not in docs and "without scipy" not in docs


def test_a_loss_band_is_drawn_from_zero_and_a_spread_has_no_sign(tmp_path: Path, monkeypatch):
    """Two seeds far apart: the t interval reaches below 0, a loss does not; the drawn band
    starts at 0 (the returned band stays the statistic). "+0.041 ± 0.009", not "± +0.009"."""
    import matplotlib.axes

    from nanolab.report.text import _mean_spread

    for seed, loss in enumerate([0.5, 3.5]):
        write_run(tmp_path, f"r-s{seed}", 0.003, seed, [(500, 4.0), (1000, loss)])
    lows: list[float] = []
    real = matplotlib.axes.Axes.fill_between

    def fill_between(ax, x, lo, hi, **kwargs):
        lows.extend(lo)
        return real(ax, x, lo, hi, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "fill_between", fill_between)
    runs = [(report.summarize_run(d.name, d), d) for d in sorted(tmp_path.iterdir())]
    (drawn,) = report.plot_runs(runs, tmp_path / "plot.png", "tokens")
    assert drawn["val_band"][-1][2] < 0  # the statistic: 2 - 12.7 * 1.5
    assert lows and min(lows) == 0.0
    assert _mean_spread(0.041, 0.009, "+.3f") == "+0.041 ± 0.009"


def test_scipy_and_safetensors_are_core_dependencies() -> None:
    """No extra to install for report's statistics and tables or for export's weights file."""
    tomllib = pytest.importorskip("tomllib")

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    core = [d.split(">")[0] for d in project["dependencies"]]
    assert "scipy" in core and "safetensors" in core and "tabulate" in core
    assert "stats" not in project["optional-dependencies"]


# -- 2. report streams the log ------------------------------------------------------------------
def _peak_bytes_of_summary(tmp_path: Path, steps: int) -> int:
    """tracemalloc's peak while one run of ``steps`` train records (and a resume) is summarized."""
    import importlib.util
    import tracemalloc

    from nanolab.runs import summarize_run

    spec = importlib.util.spec_from_file_location("report_rss", BENCHES / "report_rss.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.write_log(tmp_path / f"r{steps}", steps)
    tracemalloc.start()
    try:
        s = summarize_run("r", tmp_path / f"r{steps}")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert s.steps == steps and s.resumes == 1 and s.status == "completed"
    return peak


def test_summary_memory_does_not_grow_with_the_log(tmp_path: Path) -> None:
    """Ten times the records, about the same peak: only the validations are kept as a list
    (one small entry per 250 steps)."""
    small, large = (_peak_bytes_of_summary(tmp_path, n) for n in (2_000, 20_000))
    assert large < small + 200_000, (small, large)


def test_streamed_summary_keeps_the_resumed_timeline(tmp_path: Path) -> None:
    """A run killed at step 8 and resumed from step 5: steps 6-8 of the first attempt are gone
    from every figure; a record of the wrong shape is counted, not used."""
    import json

    from nanolab.runs import summarize_run

    def train(step: int, loss: float) -> dict:
        return {"event": "train", "time": float(step), "step": step, "tokens": 10 * step,
                "loss": loss, "tokens_per_s": 100.0 * step, "gpu_hours": step / 100}  # fmt: skip

    records = [{"event": "start", "time": 0.0, "step": 0, "config": {"x": 1}, "seed": 3}]
    records += [train(s, 10.0 - s) for s in range(1, 9)]  # the abandoned 6-8 have loss 4, 3, 2
    records += [{"event": "val", "time": 8.0, "step": 8, "tokens": 80, "val_loss": 0.5}]
    records += [{"event": "train", "time": 8.5, "step": "9"}]  # wrong shape
    records += [{"event": "start", "time": 9.0, "step": 5, "resumed_from_step": 5, "seed": 3}]
    records += [train(s, 20.0 - s) for s in range(6, 8)]  # 14, 13
    records += [{"event": "val", "time": 10.0, "step": 7, "tokens": 70, "val_loss": 1.5}]
    records += [{"event": "end", "time": 11.0, "step": 7, "reason": "completed"}]
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    s = summarize_run("r", run)
    assert (s.status, s.resumes, s.steps, s.seed, s.skipped_records) == ("completed", 1, 7, 3, 1)
    assert (s.tokens, s.train_loss, s.gpu_hours) == (70, 13.0, 0.07)
    assert s.val_points == [(70, 1.5)] and s.best_val_loss == 1.5  # the val at 8 was abandoned
    losses = [9, 8, 7, 6, 5, 14, 13]
    assert s.start_loss == 9 and s.improvement == pytest.approx(9 - sum(losses[1:]) / 6)
    # the timeline's intervals 1->2 ... 6->7: 10 tokens each at 100*step tokens/s
    assert s.tokens_per_s == pytest.approx(60 / sum(10 / (100 * s) for s in range(2, 8)))
    assert (s.started, s.updated) == (0.0, 11.0)


# -- 3. names that mean what they say ----------------------------------------------------------
def test_the_suite_mean_is_called_core_only_for_the_core_suite() -> None:
    """Shakespeare's one-task cloze is "shakespeare centered" (not "mean": its 0.280 beside
    "mean +0.040" read as a contradiction); a DCLM bundle (suite "core") is CORE;
    old records without ``suite_name`` get the name load_suite would give their ``suite``."""
    from nanolab.downstream.scoring import SuiteResult
    from nanolab.downstream.tasks import mean_label, suite_name_of
    from nanolab.eval_tasks import result_table

    assert mean_label("core") == "CORE" and mean_label("shakespeare") == "shakespeare centered"
    assert suite_name_of({"suite": "builtin:shakespeare"}) == "shakespeare"
    assert suite_name_of({"suite": "tasks/my.yaml"}) == "my"
    assert suite_name_of({"suite": "/data/eval_bundle"}) == "core"
    assert suite_name_of({"suite": "x.yaml", "suite_name": "mine"}) == "mine"
    result = SuiteResult([], 1.0, "shakespeare")
    assert result.record()["suite_name"] == "shakespeare"
    table = result_table(result)
    assert "shakespeare centered (mean of tasks)" in table and "CORE" not in table
    assert "CORE (mean of tasks)" in result_table(SuiteResult([], 1.0, "core"))


def _tasks(step: int, core: float, **extra: object) -> dict:
    return {"event": "tasks", "time": 5.0, "step": step, "suite": "builtin:shakespeare",
            "tasks/cloze/score": 0.5 + core, "tasks/core": core, **extra}  # fmt: skip


def _cpu_run(root: Path, name: str, lr: float, seed: int, extra: list[dict]) -> None:
    """A finished CPU run: start (config, accelerator), train, val, any extra records, end."""
    import json

    run = root / name
    run.mkdir(parents=True)
    config = {"model": {"optimizer": {"lr": lr}}, "seed_everything": seed}
    records = [
        {"event": "start", "time": 1.0, "step": 0, "seed": seed, "config": config,
         "accelerator": "CPUAccelerator"},
        {"event": "train", "time": 2.0, "step": 2, "tokens": 100, "loss": 3.0, "gpu_hours": 0.01},
        {"event": "val", "time": 2.0, "step": 2, "tokens": 100, "val_loss": 2.5 + lr},
        *extra,
        {"event": "end", "time": 9.0, "step": 2, "reason": "completed"},
    ]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_report_names_hours_suites_and_sources_within_100_columns(tmp_path: Path, capsys) -> None:
    """A CPU run's hours are CPU-h; the in-training score and a later `nanolab eval` score are
    both shown, each with where it came from; no table line is over 100 characters."""
    evaluated = _tasks(2, 0.30, evaluated_by="nanolab eval")
    _cpu_run(tmp_path, "sw-lr1e-3-s1", 0.001, 1, [_tasks(2, 0.10), evaluated])
    _cpu_run(tmp_path, "sw-lr1e-3-s2", 0.001, 2, [_tasks(2, 0.20)])
    assert report.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert (
        "CPU-h" in out and "GPU-h" not in out and "CORE" not in out.split("centered: the mean")[0]
    )
    rows = [line.split() for line in out.splitlines() if line.startswith("sw-lr1e-3-s1 ")]
    assert ["sw-lr1e-3-s1", "training", "2", "shakespeare", "+0.100", "0.600"] in rows
    assert ["sw-lr1e-3-s1", "nanolab", "eval", "2", "shakespeare", "+0.300", "0.800"] in rows
    table = out.split("\nseed groups")[0]
    assert max(len(line) for line in table.splitlines() if "  " in line) <= 100
    assert report.main([str(tmp_path), "--json"]) == 0
    (first, _) = __import__("json").loads(capsys.readouterr().out)["runs"]
    assert (first["core"], first["eval_core"], first["suite"]) == (0.1, 0.3, "shakespeare")


def test_a_group_keeps_its_label_whatever_run_selects(tmp_path: Path, capsys) -> None:
    """Two learning rates x two seeds: the group is ``lr=0.001`` with and without --run."""
    for lr, tag in ((0.001, "1e-3"), (0.003, "3e-3")):
        for seed in (1, 2):
            _cpu_run(tmp_path, f"sw-lr{tag}-s{seed}", lr, seed, [])
    assert report.main([str(tmp_path), "--json"]) == 0
    everyone = __import__("json").loads(capsys.readouterr().out)["seed_groups"]
    assert report.main([str(tmp_path), "--run", "sw-lr1e-3-*", "--json"]) == 0
    picked = __import__("json").loads(capsys.readouterr().out)["seed_groups"]
    assert [g["label"] for g in everyone] == ["lr=0.001", "lr=0.003"]
    assert [g["label"] for g in picked] == ["lr=0.001"]


def test_test_says_it_ran_on_the_validation_windows() -> None:
    """``nanolab test`` on nanolab's data modules (test_dataloader is val_dataloader) says which
    windows it scored; the lines are nanolab's plain ones, the loss first."""
    from nanolab.data.datamodule import TokenDataModule
    from nanolab.training.evaluate import EvalTarget, evaluation_lines

    assert TokenDataModule.test_dataloader is TokenDataModule.val_dataloader
    target = EvalTarget(Path("runs/x/checkpoints/last.ckpt"), 6, True)
    lines = evaluation_lines("test", {"test/ppl": 3.0, "test/loss": 1.0986}, target, True)
    assert lines == [
        "nanolab test: runs/x/checkpoints/last.ckpt (step 6), on the validation windows "
        "(the data has no test split of its own)",
        "  test/loss  1.0986",
        "  test/ppl   3.0000",
    ]
    assert "the data module's test split" in evaluation_lines("test", {}, target, False)[0]


# -- 4. the generated data/README.md says what prepare does ---------------------------------------
def _scaffold(tmp_path: Path) -> Path:
    from nanolab.scaffold import main as init

    project = tmp_path / "poems"
    assert init([str(project)]) == 0
    return project


def test_the_generated_data_readme_matches_meta_json(tmp_path: Path, capsys) -> None:
    """Prepare 30 text files and a 5-record .jsonl as data/README.md says, then check each of
    its claims against meta.json and the bins: the stated share and seed of a document draw
    (not the tail of the text), one document per file and per record, an end-of-text after each."""
    import json
    import re

    import numpy as np

    from nanolab.data.prepare import prepare_dataset

    project = _scaffold(tmp_path)
    readme = (project / "data" / "README.md").read_text()
    assert "last 10%" not in readme and "name order" not in readme
    share = int(re.search(r"seeded draw of (\d+)% of the documents", readme)[1]) / 100
    text = project / "data" / "text"
    for i in range(30):
        (text / f"{i:02d}.txt").write_text(f"poem {i}: " + "la " * (5 + i) + "\n")
    records = [{"text": f"record {i} " + "da " * i} for i in range(5)]
    (text / "zz.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    meta = prepare_dataset([str(text)], project / "data" / "tokens", "bytes", quiet=True)
    capsys.readouterr()
    assert meta["val_fraction"] == share and meta["split_seed"] == 0
    assert sum(meta["documents"].values()) == 30 + len(records)  # a record is a document
    ids = {
        s: np.fromfile(project / "data" / "tokens" / f"{s}.bin", meta["dtype"])
        for s in meta["documents"]
    }
    for split, tokens in ids.items():  # an end-of-text ends every document
        assert int((tokens == meta["eot_id"]).sum()) == meta["documents"][split]
        assert tokens[-1] == meta["eot_id"]
    texts = bytes(t for t in ids["val"].tolist() if t != meta["eot_id"]).decode()
    drawn = sorted(int(n) for n in re.findall(r"poem (\d+):", texts))
    assert drawn and drawn != list(range(30 - len(drawn), 30))  # not the last files by name
    assert 0 < meta["documents"]["val"] < 35 * 0.3


def test_the_records_example_keeps_each_record_a_document(tmp_path: Path) -> None:
    """The README's ``Records`` class (run as written) renders one JSON line per record, so
    prepare puts an end-of-text between records."""
    import json
    import re

    from nanolab.data.datamodule import TokenDataModule
    from nanolab.data.prepare import prepare_dataset

    project = _scaffold(tmp_path)
    readme = (project / "README.md").read_text()
    section = readme.split("## Add a dataset")[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)[1]
    namespace: dict = {"TokenDataModule": TokenDataModule}
    exec(compile(code, "README.md", "exec"), namespace)
    (project / "records.jsonl").write_text(
        "".join(json.dumps({"question": f"q{i}?", "answer": f"a{i}."}) + "\n" for i in range(4))
    )
    data = namespace["Records"](
        records=str(project / "records.jsonl"), template="Q: {question}\nA: {answer}",
        dataset_dir=str(project / "data" / "tokens-records"), tokenizer="bytes",
    )  # fmt: skip
    data.render()
    lines = data.text.read_text().splitlines()
    assert [json.loads(x)["text"] for x in lines] == [f"Q: q{i}?\nA: a{i}." for i in range(4)]
    meta = prepare_dataset([str(data.text)], tmp_path / "tokens", "bytes", quiet=True)
    assert sum(meta["documents"].values()) == 4  # an end-of-text after each record


# -- 5. smaller ------------------------------------------------------------------------------------
def test_forecast_of_a_finished_run_says_finished_and_how_well_it_fitted(tmp_path, capsys) -> None:
    """A run whose last validation is at max_steps: no forecast of the point it reached, but its
    final val loss and the fit's rmse; the same run half way is still forecast."""
    from test_forecast import _write_scheduled_run

    _write_scheduled_run(tmp_path, "done", last=400)
    _write_scheduled_run(tmp_path, "half", last=200)
    assert report.main([str(tmp_path), "--forecast"]) == 0
    out = capsys.readouterr().out.split("\nforecast:")[1]
    (done,) = [x for x in out.splitlines() if x.startswith("  done:")]
    (half,) = [x for x in out.splitlines() if x.startswith("  half:")]
    assert "finished (40 val points), final val loss" in done and "rmse" in done
    assert "at max_steps" not in done and "L0=" not in done
    assert "at max_steps (400k tokens)" in half


def test_the_export_has_a_model_card(tmp_path: Path) -> None:
    """README.md of an export: config, data, steps, val loss and bpb at the checkpoint's step,
    and the commands that trained and exported it (from the run's start record)."""
    import json

    from nanolab.export import model_card
    from nanolab.model import GPTConfig

    run = tmp_path / "runs" / "poems"
    (run / "checkpoints").mkdir(parents=True)
    config = {"data": {"init_args": {"dataset_dir": "data/tokens", "source": ["data/text"]}}}
    records = [
        {"event": "start", "time": 1.0, "step": 0, "config": config,
         "argv": ["/venv/bin/nanolab", "fit", "--config", "configs/experiment.yaml"]},
        {"event": "val", "time": 2.0, "step": 300, "tokens": 9600, "val_loss": 1.91, "val_bpb": 2.7},
        {"event": "val", "time": 3.0, "step": 600, "tokens": 19200, "val_loss": 1.5, "val_bpb": 2.1},
        {"event": "val", "time": 4.0, "step": 900, "tokens": 28800, "val_loss": 1.4, "val_bpb": 2.0},
    ]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    ckpt = {"global_step": 600, "nanolab": {"tokenizer": {"name": "chars"}}}
    card = model_card(ckpt, GPTConfig(vocab_size=65), run / "checkpoints" / "step-600.ckpt",
                      "nanolab export --ckpt runs/poems -o out")  # fmt: skip
    assert card.startswith("# poems\n")
    for row in ("| steps | 600 |", "| tokens | 19,200 |", "| val loss | 1.5000 |",
                "| val bits per byte | 2.1000 |", '`"data/tokens"`', "| tokenizer | chars, vocabulary 65",
                "`nanolab fit --config configs/experiment.yaml`",
                "`nanolab export --ckpt runs/poems -o out`", '"vocab_size": 65'):  # fmt: skip
        assert row in card, row


def test_estimate_names_a_given_micro_batch_as_given(capsys) -> None:
    """``estimate --micro-batch 8`` labels the figure ``(--micro-batch)``, not ``(config)``."""
    from nanolab.estimator.cli import main as estimate
    from nanolab.estimator.estimate import estimate_from_config

    gpt2 = Path(__file__).resolve().parents[1] / "configs" / "gpt2-124m.yaml"
    assert estimate_from_config(str(gpt2), gpu="h100").micro_batch_source == "config"
    assert estimate(["--config", str(gpt2), "--gpu", "h100", "--micro-batch", "8"]) == 0
    assert "micro-batch 8 (--micro-batch)" in capsys.readouterr().out


# -- 6. the CPU probe and the queue's ETAs ------------------------------------------------------
def test_the_probe_keeps_the_fastest_of_its_short_repeats(monkeypatch) -> None:
    """Single matmuls timed one by one (a neighbour's load makes some slow): the rate is the
    fastest one's, 2 n^3 FLOPs over its seconds."""
    import itertools

    from nanolab.estimator import cpu

    durations = itertools.cycle([0.050, 0.004, 0.030, 0.002, 0.040])
    clock = {"t": 0.0, "open": False}

    def perf_counter() -> float:  # start/stop pairs advance by the next duration
        if clock["open"]:
            clock["t"] += next(durations)
        clock["open"] = not clock["open"]
        return clock["t"]

    monkeypatch.setattr(cpu.time, "perf_counter", perf_counter)
    monkeypatch.setattr(cpu.time, "sleep", lambda s: None)
    clock["open"] = True  # the deadline's read is a lone call
    rate = cpu.matmul_tflops("float32", seconds=10.0, n=64, threads=1)
    assert rate == pytest.approx(2 * 64**3 / 0.002 / 1e12)


def test_the_queue_uses_a_configs_measured_step_time_before_a_probe(tmp_path, monkeypatch) -> None:
    """A finished job of the same config whose log shows 0.5 s per step after start-up: a new
    job of 400 steps is STARTUP_S + 200 s, with no FLOP estimate (no CPU probe) at all."""
    import json

    from nanolab.queue import predict
    from nanolab.queue.db import NewJob, QueueDB
    from nanolab.queue.jobs import ParsedConfig, config_key

    config = {"model": {"gpt": {"n_layer": 2}}, "trainer": {"max_steps": 100}}
    run = tmp_path / "runs" / "old"
    run.mkdir(parents=True)
    db = QueueDB(tmp_path / "q.db")
    key = config_key(config)
    (old,) = db.add_jobs(
        [NewJob("old", "c.yaml", [], 1, str(tmp_path), str(run), key, max_steps=100)]
    )
    db.set_status(old.id, "done", run_seconds=90.0)
    start = {"event": "start", "time": old.created, "step": 0, "queue_job": str(old.id),
             "config": config, "devices": ["cpu"]}  # fmt: skip
    train = [
        {"event": "train", "step": s, "elapsed_s": 20.0 + 0.5 * (s - 1)} for s in range(1, 101)
    ]
    end = {"event": "end", "step": 100, "elapsed_s": 20.0 + 0.5 * 99, "reason": "completed"}
    lines = [start, *train, end]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))

    def no_probe(*args, **kwargs):
        raise AssertionError("probed although the config has run before")

    monkeypatch.setattr(predict, "flops_estimate", no_probe)
    parsed = ParsedConfig(config, "runs", 400, 1, 1024)
    seconds, how = predict.job_estimate(db, parsed)
    assert seconds == pytest.approx(predict.STARTUP_S + 0.5 * 400)
    assert how == "measured step time of 1 past run of this config"
    (new,) = db.add_jobs([NewJob("new", "c.yaml", [], 2, str(tmp_path), str(tmp_path / "n"), key,
                                 max_steps=400)])  # fmt: skip
    assert predict.remaining_seconds(db, new)[0] == pytest.approx(predict.STARTUP_S + 200)


def test_fit_without_a_config_says_what_it_trains_and_where_the_quickstart_is(
    tmp_path: Path,
) -> None:
    """``nanolab fit`` with no --config started the code's defaults (6 x 384, 5,000 steps: hours
    on a CPU) without a word. It still runs (a launch from options alone is a way to run), with
    one warning line first: no --config, what it trains, and the quickstart's command. A launch
    with a config has no such line."""
    from conftest import QUICKSTART, nanolab_here

    bare = nanolab_here("fit", "--trainer.max_steps", "0", cwd=tmp_path)  # refused after it
    lines = bare.stderr.splitlines()
    assert lines[0] == (
        "nanolab fit: warning: no --config given: training the code's defaults and the options "
        "given, a 6-layer, 384-wide GPT on data/shakespeare_char; for the small first run: "
        "nanolab fit --config configs/quickstart.yaml"
    ), bare.stderr
    assert bare.returncode == 2 and "trainer.max_steps" in lines[1]
    given = nanolab_here("fit", "--config", str(QUICKSTART), "--trainer.max_steps", "0",
                         cwd=tmp_path)  # fmt: skip
    assert given.returncode == 2 and "no --config" not in given.stderr, given.stderr
