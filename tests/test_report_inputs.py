"""What ``nanolab report`` is handed: folders of runs that overlap (one inside another, or one
folder named twice)."""

from __future__ import annotations

import json
from pathlib import Path

from test_report import run_report, write_run

from nanolab.runs import discover_runs


def test_overlapping_folders_count_each_run_once(tmp_path: Path, monkeypatch, capsys) -> None:
    runs = tmp_path / "runs"
    for seed in (1, 2, 3):
        write_run(runs / "debug", f"x-s{seed}", seed=seed, losses=[3.0], vals={1: 2.5 + seed / 10})
    monkeypatch.chdir(tmp_path)
    for roots in (["runs", "runs/debug"], ["runs", "./runs"], ["runs/debug/x-s1", "runs"]):
        found = discover_runs([Path(r) for r in roots])
        assert sorted(d.resolve() for _, d in found) == sorted(
            (runs / "debug" / f"x-s{s}").resolve() for s in (1, 2, 3)
        ), roots
        code, out, err = run_report(capsys, *roots, "--json")
        assert code == 0, err
        (group,) = json.loads(out)["seed_groups"]
        assert group["n"] == 3, roots
