"""``nanolab report --plot`` over a run with nothing finite to draw, and over a long log (what
the plot keeps of it)."""

from __future__ import annotations

from pathlib import Path

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
