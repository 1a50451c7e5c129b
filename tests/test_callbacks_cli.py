"""``nanolab fit`` with the callbacks on by default: a budget stop, a refused run directory, bad input."""

from __future__ import annotations

import pytest
from conftest import QUICKSTART, nanolab_here, run_nanolab, tiny_overrides, write_config

from nanolab.runlog import read_records


@pytest.mark.slow  # three CLI processes: most of the time is importing torch and Lightning
def test_fit_stops_on_budget_and_refuses_a_different_run(tmp_path, char_dataset):
    cfg = write_config(tmp_path / "tiny.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    base = ["fit", "--config", str(QUICKSTART), "--config", str(cfg)]
    res = run_nanolab(
        *base, "--budget.max_tokens", "512", "--checkpoint.every_n_steps", "2", cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "runs" / "tiny"
    records = read_records(run / "metrics.jsonl")
    end = records[-1]
    assert end["event"] == "end" and end["reason"] == "budget" and end["tokens"] <= 512
    assert records[0]["config"]["budget"]["max_tokens"] == 512
    assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "config.yaml").is_file()

    log, config = (run / "metrics.jsonl").read_bytes(), (run / "config.yaml").read_bytes()
    res = run_nanolab(*base, "--run.resume", "never", "--model.optimizer.lr", "1e-3", cwd=tmp_path)
    assert res.returncode == 2
    assert "already holds run" in res.stderr and "run.fresh: true" in res.stderr
    assert "Traceback" not in res.stderr
    assert (run / "metrics.jsonl").read_bytes() == log  # nothing written, nothing overwritten
    assert (run / "config.yaml").read_bytes() == config

    res = run_nanolab(*base, "--run.fresh", "true", "--trainer.max_steps", "2", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    (archived,) = (run / "previous").iterdir()
    assert (archived / "metrics.jsonl").read_bytes() == log
    assert read_records(run / "metrics.jsonl")[0]["event"] == "start"
    assert read_records(run / "metrics.jsonl", "end")[-1]["reason"] == "completed"


def test_bad_callback_settings_exit_2_before_anything_is_written(tmp_path, char_dataset):
    cfg = write_config(tmp_path / "tiny.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    res = nanolab_here(  # a refusal: in this process (a refused fit's own: test_adversarial)
        "fit", "--config", str(QUICKSTART), "--config", str(cfg),
        "--budget.price_per_gpu_hour", "2.5", "--budget.currency", "bitcoins",
        cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 2
    assert "budget.currency 'bitcoins' is not a known ISO 4217 code" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "runs" / "tiny").exists()
