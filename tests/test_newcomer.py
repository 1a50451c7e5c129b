"""A newcomer's findings: labels that say what they are, and claims checked against the data."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from nanolab import report
from tests.test_report_stats import T_975_DF2, write_run


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
