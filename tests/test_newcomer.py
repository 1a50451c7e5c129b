"""A newcomer's findings: labels that say what they are, and claims checked against the data."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from nanolab import report
from tests.test_report_stats import T_975_DF2, write_run

BENCHES = Path(__file__).resolve().parents[1] / "benches"


# -- 1. the plot's band is what its title says ------------------------------------------------
def test_plot_band_is_the_t_interval_its_title_names(tmp_path: Path, monkeypatch) -> None:
    """Three seeds at 1.0, 1.2, 1.1: the band is 1.1 ± t(0.975, 2) 0.1 / sqrt(3), never the
    min-max; the figure's title says so, and so does docs/queue.md."""
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
    assert titles == [report.BAND_TITLE] and "95% confidence interval" in titles[0]
    docs = (Path(__file__).parents[1] / "docs" / "queue.md").read_text()
    assert "min–max" not in docs and "without scipy" not in docs


def test_scipy_and_safetensors_are_core_dependencies() -> None:
    """No extra to install for report's statistics or for export's weights file."""
    tomllib = pytest.importorskip("tomllib")

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    core = [d.split(">")[0] for d in project["dependencies"]]
    assert "scipy" in core and "safetensors" in core
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
    assert s.tokens_per_s == pytest.approx(100 * sum([1, 2, 3, 4, 5, 6, 7]) / 7)
    assert (s.started, s.updated) == (0.0, 11.0)
