"""``nanolab report --plot`` over a run with nothing finite to draw, and over a long log (what
the plot keeps of it)."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest
from test_report import run_report, write_run


def test_a_run_diverged_before_its_first_validation_is_left_out_of_the_plot(
    tmp_path: Path, capsys
) -> None:
    runs = tmp_path / "runs"
    write_run(runs, "ok-s1", seed=1, losses=[3.0, 2.8], vals={2: 2.7})
    write_run(runs, "ok-s2", seed=2, losses=[3.0, 2.9], vals={2: 2.75})
    div = write_run(runs, "div", seed=3, lr=0.1, losses=[3.0, 9.0], vals={2: 1.0}, end="diverged")
    log = div / "metrics.jsonl"
    log.write_text(log.read_text().replace('"val_loss": 1.0', '"val_loss": null'))
    out_png = tmp_path / "loss.png"
    code, out, err = run_report(capsys, str(runs), "--plot", str(out_png))
    assert code == 0, err
    assert out_png.is_file()
    assert "ok-s1" in out and "div " in out  # the table
    assert f"plot: {out_png} (not drawn: div (no finite val loss))" in out


def _long_run(root: Path, steps: int) -> Path:
    """A log of ``steps`` train records (a long run in small), validated every 1,000 steps."""
    run_dir = root / "long"
    run_dir.mkdir(parents=True)
    config = {"trainer": {"max_steps": 2 * steps}, "model": {"optimizer": {"lr": 0.003}}}
    lines = [json.dumps({"event": "start", "time": 0.0, "step": 0, "seed": 1, "config": config})]
    for i in range(1, steps + 1):
        lines.append(json.dumps({"event": "train", "time": 1.0 + i, "step": i, "tokens": 64 * i,
                                 "loss": 4.0 - i / steps, "lr": 0.003, "gpu_hours": i / 3600,
                                 "grad_norm": 1.0, "tokens_per_s": 1000.0}))  # fmt: skip
        if i % 1000 == 0:
            lines.append(json.dumps({"event": "val", "time": 1.5 + i, "step": i,
                                     "tokens": 64 * i, "val_loss": 4.1 - i / steps}))  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


def _peak_mib(fn) -> float:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


@pytest.mark.slow  # a row of a kind the default run covers (the suite's time)
def test_a_long_log_is_streamed_by_the_plot_and_the_forecast(tmp_path: Path) -> None:
    """40,000 train records: held as dicts they take ~40 MiB; the plot keeps a thinned curve
    (at most TRAIN_POINTS + 1 points) and the forecast its val points and a sample of LRs."""
    from nanolab.report import forecast_inputs, plot_runs, summarize_run

    run_dir = _long_run(tmp_path, 40_000)
    summary = summarize_run("long", run_dir)
    inputs = forecast_inputs(run_dir)  # warm: imports are not the log
    assert len(inputs.points) == 40 and inputs.tokens_per_step == 64
    assert _peak_mib(lambda: forecast_inputs(run_dir)) < 4
    out = tmp_path / "loss.png"
    plot_runs([(summary, run_dir)], out, "tokens")
    assert _peak_mib(lambda: plot_runs([(summary, run_dir)], out, "gpu_hours")) < 8

    from nanolab.report.plot import TRAIN_POINTS, read_for_plot

    curve = read_for_plot(run_dir, "tokens").train_curve()
    assert len(curve) <= TRAIN_POINTS + 1 and max(curve) == 40_000


def test_the_plot_reads_each_log_once_along_the_summarys_pass(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``report --plot`` (and ``--forecast`` with it) draws from what the summary's own pass
    over each log handed it: one read of a long log, not three (500k records: seconds each)."""
    import nanolab.runs as runs_module

    runs = tmp_path / "runs"
    write_run(runs, "a-s1", seed=1, losses=[3.0, 2.8, 2.6], vals={2: 2.7})
    write_run(runs, "a-s2", seed=2, losses=[3.0, 2.9, 2.7], vals={2: 2.75})
    passes: list[str] = []
    real = runs_module.iter_numbered

    def counted(log, *args, **kwargs):
        if kwargs.get("containing") != '"start"':  # not the look for where resumes rewound
            passes.append(Path(log).parent.name)
        return real(log, *args, **kwargs)

    monkeypatch.setattr(runs_module, "iter_numbered", counted)
    out_png = tmp_path / "loss.png"
    code, out, err = run_report(capsys, str(runs), "--plot", str(out_png), "--forecast")
    assert code == 0, err
    assert out_png.is_file() and f"plot: {out_png}" in out
    assert sorted(passes) == ["a-s1", "a-s2"]


def test_the_plotted_train_curve_of_one_pass_is_the_trailing_mean_of_1_40_of_the_records(
    tmp_path: Path,
) -> None:
    """Read in one pass, the curve is still the mean of the last 1/40 of the train records at
    each drawn step; a val record without an x (no GPU-hours) takes its train record's."""
    import random
    import statistics

    from nanolab.report.plot import read_for_plot

    rng = random.Random(0)
    losses = [rng.uniform(1, 5) for _ in range(400)]
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    lines = [{"event": "start", "time": 0.0, "step": 0, "seed": 1, "config": {}}]
    for i, loss in enumerate(losses, 1):
        lines.append({"event": "train", "time": float(i), "step": i, "tokens": 8 * i,
                      "gpu_hours": i / 100, "loss": loss})  # fmt: skip
        if i % 100 == 0:
            lines.append({"event": "val", "time": i + 0.5, "step": i, "val_loss": 2.0})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    reader = read_for_plot(run_dir, "gpu_hours")
    curve = reader.train_curve()
    assert sorted(curve) == list(range(1, 401))
    for step, (x, y) in curve.items():
        assert x == step / 100
        window = losses[max(0, step - 10) : step]  # 400 records: a window of 10
        assert y == pytest.approx(statistics.fmean(window), rel=1e-12)
    assert reader.xs == {100: 1.0, 200: 2.0, 300: 3.0, 400: 4.0}


def test_a_plot_leaves_another_reports_half_drawn_image_alone(tmp_path: Path, capsys) -> None:
    """Two reports drawing to one file (two shells): each draws under a name of its own, so
    neither overwrites, publishes nor deletes the other's unfinished image."""
    runs = tmp_path / "runs"
    write_run(runs, "a", seed=1, losses=[3.0, 2.8], vals={2: 2.7})
    out_png = tmp_path / "loss.png"
    others = [tmp_path / ".loss.tmp.png", tmp_path / ".loss.png.tmp"]
    for other in others:
        other.write_bytes(b"another report, still drawing")
    code, _, err = run_report(capsys, str(runs), "--plot", str(out_png))
    assert code == 0, err
    assert out_png.read_bytes().startswith(b"\x89PNG")
    for other in others:
        assert other.read_bytes() == b"another report, still drawing"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["runs", "loss.png", *(o.name for o in others)]
    )


def test_report_forecast_reads_each_log_once(tmp_path: Path, capsys, monkeypatch) -> None:
    """The forecast takes what it needs along the summary's own pass over a log (a 500k-record
    log took 4 s more CPU read a second time): each line is parsed once, the few start lines
    twice (the first look for where resumes rewound to)."""
    import nanolab.runlog as runlog

    run_dir = _long_run(tmp_path / "runs", 3000)
    lines = len((run_dir / "metrics.jsonl").read_text().splitlines())
    parsed = []
    real_parse = runlog._parse
    monkeypatch.setattr(runlog, "_parse", lambda line: parsed.append(1) or real_parse(line))
    code, out, err = run_report(capsys, str(tmp_path / "runs"), "--forecast")
    assert code == 0, err
    assert "long: no forecast (3 usable validation point(s)" in out
    assert len(parsed) <= lines + 1


def test_the_forecast_leaves_out_validations_a_resume_abandoned(tmp_path: Path) -> None:
    """A run validated at steps 2 and 4, then resumed from its step-2 checkpoint: the step-4
    validation belongs to the abandoned timeline (as in the report's own curve), and is not a
    point of the forecast until the resumed run validates step 4 again."""
    from nanolab.report import forecast_inputs, summarize_run

    run_dir = write_run(tmp_path, "r", losses=[4.0, 3.5, 3.1, 2.9], vals={2: 3.2, 4: 2.5}, end=None)
    log = run_dir / "metrics.jsonl"
    resumed = {"event": "start", "time": 0.0, "step": 2, "resumed_from_step": 2,
               "config": json.loads(log.read_text().splitlines()[0])["config"]}  # fmt: skip
    train = {"event": "train", "time": 1.0, "step": 3, "tokens": 3000, "loss": 3.0}
    with log.open("a") as f:
        f.write(json.dumps(resumed) + "\n" + json.dumps(train) + "\n")
    assert summarize_run("r", run_dir).val_points == [(2000, 3.2)]
    assert [p[0] for p in forecast_inputs(run_dir).points] == [2.0]
