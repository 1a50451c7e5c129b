"""Compile once per config, not once per job: the queue points every job's inductor and Triton
caches at ``nanolab_queue_cache/`` beside its database, so the second seed of a
``model.compile: true`` config loads the kernels the first one compiled (inductor compiles C++
kernels on a CPU too). Real ``nanolab fit`` processes; slow because the first compile is.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_overrides, write_config

from nanolab.queue.cli import main
from nanolab.queue.db import QueueDB
from nanolab.runlog import read_records


def _first_step_s(run_dir: Path) -> float:
    """Seconds from the run's ``start`` record to its first ``train`` record (compile time)."""
    log = run_dir / "metrics.jsonl"
    return read_records(log, "train")[0]["time"] - read_records(log, "start")[0]["time"]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="inductor needs a C++ compiler on CPU")  # fmt: skip
def test_second_job_of_a_compiled_config_starts_warm(
    tmp_path: Path, char_dataset: Path, monkeypatch
) -> None:
    """Two seeds of one compiled config, back to back: the first fills the queue's cache
    folder and the second reaches its first step in well under half the time.

    Mutations caught: the cache variables not passed to jobs (the kernels land in PyTorch's
    default folder under ``$TMPDIR``, and the queue's folder stays empty).
    """
    monkeypatch.chdir(tmp_path)
    cfg = tiny_overrides(
        char_dataset, tmp_path / "runs", trainer__max_steps=4, trainer__accelerator="cpu"
    )
    del cfg["run"]["name"]
    cfg["model"]["compile"] = True
    path = write_config(tmp_path / "compiled.yaml", cfg)
    db = tmp_path / "q.db"
    assert main(["add", str(path), "--db", str(db), "--seeds", "1,2"]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        env.pop(name, None)
    # PyTorch's default cache (/tmp/torchinductor_$USER) would also warm the second job on this
    # machine; point the default somewhere empty so only the queue's folder can.
    env["TMPDIR"] = str(tmp_path / "tmp")
    (tmp_path / "tmp").mkdir()
    res = subprocess.run(
        [sys.executable, "-m", "nanolab", "queue", "run", "--db", str(db)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=800,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:]
    assert [j.status for j in QueueDB(db).jobs()] == ["done", "done"]
    cache = tmp_path / "nanolab_queue_cache" / "inductor"
    assert cache.is_dir() and any((cache / "fxgraph").rglob("*")), "the queue's cache is empty"
    default = list((tmp_path / "tmp").glob("torchinductor_*/fxgraph/*"))
    assert default == [], "compiled graphs went to PyTorch's default folder"
    cold = _first_step_s(tmp_path / "runs" / "compiled-s1")
    warm = _first_step_s(tmp_path / "runs" / "compiled-s2")
    print(f"start -> first step: cold {cold:.1f}s, warm {warm:.1f}s")
    assert warm < 0.5 * cold, (cold, warm)
