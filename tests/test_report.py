"""``nanolab report`` over run logs in every state: finished, stopped, crashed, running, resumed.

The logs are written here by hand, record by record, in the schema the JSONL callback writes
(README "metrics.jsonl"), so each expected figure is known independently of the report's code.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import hold_like_a_live_launch, run_nanolab, tiny_overrides, write_config

from nanolab.report import main, summarize_run
from nanolab.runlog import read_records

CONFIG = {
    "seed_everything": 1,
    "run": {"name": "x", "root": "runs", "resume": "auto"},
    "trainer": {"max_steps": 10, "default_root_dir": "runs/x"},
    "model": {"gpt": {"n_layer": 2, "n_embd": 32}, "optimizer": {"lr": 0.003}},
}


def _config(name: str, seed: int, lr: float = 0.003) -> dict:
    cfg = json.loads(json.dumps(CONFIG))
    cfg["seed_everything"], cfg["run"]["name"] = seed, name
    cfg["trainer"]["default_root_dir"] = f"runs/{name}"
    cfg["model"]["optimizer"]["lr"] = lr
    return cfg


def write_run(
    root: Path,
    name: str,
    *,
    seed: int = 1,
    lr: float = 0.003,
    losses: list[float],
    vals: dict[int, float],
    end: str | None = "completed",
    t0: float | None = None,
    error: str | None = None,
    torn_tail: bool = False,
    tokens_per_step: int = 1000,
) -> Path:
    """A run log: start, one train record per loss, val records at the given steps, an end."""
    t0 = time.time() - 100 if t0 is None else t0
    run_dir = root / name
    run_dir.mkdir(parents=True)
    recs: list[dict] = [
        {"event": "start", "time": t0, "step": 0, "run_name": name, "seed": seed,
         "resumed_from_step": None, "config": _config(name, seed, lr)},
    ]  # fmt: skip
    for i, loss in enumerate(losses, start=1):
        recs.append(
            {"event": "train", "time": t0 + i, "step": i, "tokens": i * tokens_per_step,
             "loss": loss, "tokens_per_s": 500.0 + i, "mfu": 0.25, "step_time_s": 1.0,
             "elapsed_s": float(i), "gpu_hours": i / 3600, "cost": i / 3600 * 2.0}
        )  # fmt: skip
        if i in vals:
            recs.append(
                {"event": "val", "time": t0 + i + 0.5, "step": i, "tokens": i * tokens_per_step,
                 "val_loss": vals[i], "val_ppl": 2.718 ** vals[i]}
            )  # fmt: skip
    n = len(losses)
    if end is not None:
        recs.append(
            {"event": "end", "time": t0 + n + 1, "step": n, "reason": end, "error": error,
             "elapsed_s": n + 1.0, "gpu_hours": (n + 1) / 3600, "cost": (n + 1) / 1800,
             "tokens": n * tokens_per_step, "best_val_loss": min(vals.values(), default=None)}
        )  # fmt: skip
    text = "".join(json.dumps(r) + "\n" for r in recs)
    if torn_tail:
        text += '{"event": "train", "time": 1, "st'  # killed mid-write
    (run_dir / "metrics.jsonl").write_text(text)
    if end is None:  # its launch still holds the run (or was killed: the file stays)
        hold_like_a_live_launch(run_dir)
    return run_dir


def run_report(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_finished_run_figures_and_torn_last_line(tmp_path: Path, capsys) -> None:
    losses = [4.0, 3.5, 3.1, 2.9, 2.8, 2.6]
    write_run(tmp_path, "a", losses=losses, vals={3: 3.0, 6: 2.7}, torn_tail=True)
    code, out, err = run_report(capsys, str(tmp_path), "--json")
    assert code == 0, err
    (run,) = json.loads(out)["runs"]
    assert run["status"] == "completed"
    assert run["steps"] == 6 and run["tokens"] == 6000
    assert run["train_loss"] == 2.6
    assert (run["best_val_loss"], run["best_val_step"]) == (2.7, 6)
    # Δ train loss: the first step's loss minus the mean of the last 10 after it (here: 2..6).
    assert run["start_loss"] == 4.0
    assert run["improvement"] == pytest.approx(4.0 - statistics.fmean(losses[1:]))
    # Each record's rate covers the 1,000 tokens since the record before: their tokens over
    # their time (a harmonic mean), not the mean of the rates.
    assert run["tokens_per_s"] == pytest.approx(
        statistics.harmonic_mean([500.0 + i for i in range(2, 7)])
    )
    assert run["mfu"] == pytest.approx(0.25)
    assert run["gpu_hours"] == pytest.approx(7 / 3600) and run["cost"] == pytest.approx(7 / 1800)
    assert run["wall_s"] == 7.0


def test_tokens_per_s_is_the_tokens_of_the_recent_intervals_over_their_time() -> None:
    from nanolab.runs import recent_rates

    # A busy machine: 1,000 tokens in 0.1 s, then 1,000 in 1 s, then 2,000 in 1 s (MFU follows).
    records = [
        {"step": 1, "tokens": 1000, "tokens_per_s": 9999.0, "mfu": 0.9},
        {"step": 2, "tokens": 2000, "tokens_per_s": 10000.0, "mfu": 0.5},
        {"step": 3, "tokens": 3000, "tokens_per_s": 1000.0, "mfu": 0.05},
        {"step": 5, "tokens": 5000, "tokens_per_s": 2000.0, "mfu": 0.1},
    ]
    tokens_per_s, mfu = recent_rates(records)
    assert tokens_per_s == pytest.approx(4000 / 2.1)  # the mean of the rates: 4,333
    assert mfu == pytest.approx((0.5 * 0.1 + 0.05 * 1 + 0.1 * 1) / 2.1)
    # Without two usable records: the last record's own.
    assert recent_rates(records[-1:]) == (2000.0, 0.1)
    assert recent_rates([{"step": 1, "tokens": None, "tokens_per_s": 5.0}] * 2) == (5.0, None)
    assert recent_rates([]) == (None, None)


def test_statuses_running_crashed_stopped_error(tmp_path: Path, capsys) -> None:
    now = time.time()
    write_run(tmp_path, "live", losses=[3.0, 2.9], vals={}, end=None, t0=now - 5)
    write_run(tmp_path, "dead", losses=[3.0, 2.9], vals={}, end=None, t0=now - 7200)
    write_run(tmp_path, "budget", losses=[3.0, 2.5], vals={2: 2.6}, end="budget")
    write_run(
        tmp_path, "boom", losses=[3.0], vals={}, end="error",
        error="Traceback ...\nRuntimeError: CUDA out of memory",
    )  # fmt: skip
    code, out, _ = run_report(capsys, str(tmp_path), "--json")
    assert code == 0
    status = {r["run"]: (r["status"], r["detail"]) for r in json.loads(out)["runs"]}
    assert status["live"] == ("running", None)
    assert status["dead"][0] == "crashed" and "silent for 1h59m" in status["dead"][1]
    assert status["budget"] == ("budget", None)
    assert status["boom"][0] == "error" and "out of memory" in status["boom"][1]
    code, table, _ = run_report(capsys, str(tmp_path))
    assert "error: RuntimeError: CUDA out of memory" in table
    assert "crashed: no end record" in table


def test_a_run_whose_lock_names_a_dead_process_of_this_host_is_crashed_at_once(
    tmp_path: Path, capsys
) -> None:
    """A run killed with SIGKILL read as running (with an ETA in ``status``) for 10 minutes,
    though its lock file named a process of this host that was gone."""
    import socket

    from nanolab.cli import main as nanolab_main
    from nanolab.processes import RUN_LOCK_NAME, pid_namespace

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # exited and reaped: its pid names no process
    host, here = socket.gethostname(), pid_namespace()
    now = time.time()
    # "container": a process numbered in another PID namespace of a same-named host (docker
    # --network host); "older": a lock file that does not say its namespace (an older nanolab's,
    # its flock free: gone); "older held": the same with its flock held (an older nanolab in a
    # same-named container, its pid numbered there: alive, though the pid names none here).
    for name, holder in (("killed", {"host": host, "pid": gone.pid, "pid_namespace": here}),
                         ("live", {"host": host, "pid": os.getpid(), "pid_namespace": here}),
                         ("elsewhere", {"host": host + "-other", "pid": gone.pid}),
                         ("container", {"host": host, "pid": gone.pid, "pid_namespace": "pid:[1]"}),
                         ("older", {"host": host, "pid": gone.pid}),
                         ("older held", {"host": host, "pid": gone.pid}),
                         ("unlocked", None)):  # fmt: skip
        run_dir = write_run(tmp_path, name, losses=[3.0, 2.9], vals={}, end=None, t0=now - 5)
        if holder is not None:
            (run_dir / RUN_LOCK_NAME).write_text(json.dumps({**holder, "started": "now"}))
        else:
            (run_dir / RUN_LOCK_NAME).unlink()
    held = os.open(tmp_path / "older held" / RUN_LOCK_NAME, os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        code, out, _ = run_report(capsys, str(tmp_path), "--json")
        status = {r["run"]: (r["status"], r["detail"]) for r in json.loads(out)["runs"]}
        for name in ("killed", "older"):
            assert code == 0 and status[name] == (
                "crashed", f"no end record; its process (pid {gone.pid} on {host}) is gone"
            ), name  # fmt: skip
        alive_or_unknown = ("live", "elsewhere", "container", "older held")
        for name in alive_or_unknown:
            assert status[name] == ("running", None), name
        # No lock file: no process holds the run, however recent its log (its end record lost).
        assert status["unlocked"] == (
            "crashed",
            "no end record and no run lock",
        )
        assert nanolab_main(["status", str(tmp_path)]) == 0
        shown = capsys.readouterr().out
        # The detail is in the row, or whole below the table when long (the pid's digits decide).
        killed = [x for x in shown.splitlines() if x.split()[:1] in (["killed"], ["killed:"])]
        assert "running (4)" in shown and killed, shown
        assert any(f"no end record; its process (pid {gone.pid}" in x for x in killed), shown
    finally:
        os.close(held)


def test_a_failed_run_says_its_resumes_as_a_finished_one_does(tmp_path: Path, capsys) -> None:
    """A run resumed once that then diverged: the table says the resume as ``--json`` does."""
    run_dir = write_run(tmp_path, "dv", losses=[4.0, 3.0], vals={}, end=None)
    t = time.time()
    extra = [
        {"event": "start", "time": t, "step": 2, "resumed_from_step": 2, "seed": 1,
         "config": _config("dv", 1)},
        {"event": "train", "time": t + 1, "step": 3, "loss": 9.0, "tokens": 3000},
        {"event": "end", "time": t + 2, "step": 3, "reason": "diverged", "error": "at step 3"},
    ]  # fmt: skip
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in extra)
    code, out, _ = run_report(capsys, str(tmp_path), "--json")
    assert code == 0 and json.loads(out)["runs"][0]["resumes"] == 1
    code, table, _ = run_report(capsys, str(tmp_path))
    assert "diverged: at step 3 (+1 resume)" in table


def test_resumed_run_counts_the_surviving_timeline(tmp_path: Path) -> None:
    """Killed after step 6 with a checkpoint at 4: steps 5-6 are redone; the redo counts."""
    run_dir = write_run(tmp_path, "r", losses=[4.0, 3.0, 2.5, 2.2, 9.9, 9.9], vals={}, end=None)
    t = time.time()
    extra = [{"event": "start", "time": t, "step": 4, "resumed_from_step": 4, "seed": 1,
              "config": _config("r", 1)}]  # fmt: skip
    for step, loss in ((5, 2.0), (6, 1.9), (7, 1.8)):
        extra.append({"event": "train", "time": t + step, "step": step, "loss": loss,
                      "tokens": step * 1000})  # fmt: skip
    extra.append({"event": "val", "time": t + 8, "step": 7, "val_loss": 1.95, "tokens": 7000})
    extra.append({"event": "end", "time": t + 9, "step": 7, "reason": "completed"})
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in extra)
    s = summarize_run("r", run_dir)
    assert (s.status, s.resumes, s.steps, s.train_loss) == ("completed", 1, 7, 1.8)
    # The surviving timeline: steps 1-4 of the first launch, 5-7 of the resume.
    assert s.improvement == pytest.approx(4.0 - statistics.fmean([3.0, 2.5, 2.2, 2.0, 1.9, 1.8]))
    assert s.tokens == 7000


def test_seed_groups_mean_and_std(tmp_path: Path, capsys) -> None:
    finals = {"base-s1": 2.50, "base-s2": 2.60, "base-s3": 2.45}
    for i, (name, final) in enumerate(finals.items(), start=1):
        write_run(tmp_path, name, seed=i, losses=[3.0, 2.8], vals={1: 2.9, 2: final})
    write_run(tmp_path, "other-lr", seed=1, lr=0.001, losses=[3.0], vals={1: 2.2})
    code, out, _ = run_report(capsys, str(tmp_path), "--json")
    assert code == 0
    (group,) = json.loads(out)["seed_groups"]
    assert sorted(group["runs"]) == sorted(finals) and group["seeds"] == [1, 2, 3]
    assert group["mean_val_loss"] == pytest.approx(statistics.fmean(finals.values()))
    assert group["std_val_loss"] == pytest.approx(statistics.stdev(finals.values()))
    assert group["label"] == "lr=0.003"  # what sets it apart from the other group
    _, table, _ = run_report(capsys, str(tmp_path))
    mean, std = statistics.fmean(finals.values()), statistics.stdev(finals.values())
    half = 4.302652729911275 * std / 3**0.5  # Student t, 2 degrees of freedom, 97.5%
    assert f"lr=0.003: {mean:.4f} ± {half:.4f} at 2,000 tokens  (n=3" in table
    assert group["ci_val_loss"] == pytest.approx(half)


def test_sort_and_select(tmp_path: Path, capsys) -> None:
    write_run(tmp_path, "lr-a", losses=[3.0], vals={1: 2.9})
    write_run(tmp_path, "lr-b", losses=[3.0], vals={1: 2.1})
    write_run(tmp_path, "z", losses=[3.0], vals={1: 2.5})
    _, out, _ = run_report(capsys, str(tmp_path), "--json", "--sort", "best_val_loss")
    assert [r["run"] for r in json.loads(out)["runs"]] == ["lr-b", "z", "lr-a"]
    _, out, _ = run_report(capsys, str(tmp_path), "--json", "--sort=-best_val_loss", "--run", "lr*")
    assert [r["run"] for r in json.loads(out)["runs"]] == ["lr-a", "lr-b"]


def test_bad_input_is_one_clear_line(tmp_path: Path, capsys) -> None:
    write_run(tmp_path / "runs", "a", losses=[3.0], vals={})
    code, _, err = run_report(capsys, str(tmp_path / "runs"), "--sort", "loss_of_val")
    assert code == 2 and "unknown field 'loss_of_val'" in err and "best_val_loss" in err
    code, _, err = run_report(capsys, str(tmp_path / "runs"), "--run", "nope")
    assert code == 2 and "no run named 'nope'" in err and "runs found: a" in err
    (tmp_path / "empty").mkdir()
    code, _, err = run_report(capsys, str(tmp_path / "empty"))
    assert code == 2 and "nanolab report: error: no runs under" in err
    code, _, err = run_report(capsys, str(tmp_path / "missing"))
    assert code == 2 and "does not exist" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("made", [True, False], ids=["empty runs", "no runs folder"])
def test_no_runs_names_the_absolute_folder_and_how_to_point_elsewhere(
    tmp_path: Path, capsys, monkeypatch, made: bool
) -> None:
    """``no runs under runs``: run from another folder, the relative default named no place to
    look for and no way to give another one."""
    monkeypatch.chdir(tmp_path)
    if made:
        (tmp_path / "runs").mkdir()
    code, _, err = run_report(capsys)
    why = "no metrics.jsonl found" if made else "the folder does not exist"
    assert code == 2 and err.startswith(
        f"nanolab report: error: no runs under {tmp_path / 'runs'} ({why}); "
    )
    assert err.rstrip().endswith("or name the folder: nanolab report PROJECT/runs")
    assert err.count("\n") == 1


def test_plot_tokens_and_gpu_hours(tmp_path: Path, capsys) -> None:
    write_run(tmp_path / "runs", "a", losses=[3.0, 2.5, 2.2], vals={2: 2.6, 3: 2.3})
    write_run(tmp_path / "runs", "b", seed=2, losses=[3.1, 2.6, 2.1], vals={3: 2.2})
    for x in ("tokens", "gpu_hours"):
        out = tmp_path / f"loss-{x}.png"
        code, _, err = run_report(capsys, str(tmp_path / "runs"), "--plot", str(out), "--x", x)
        assert code == 0, err
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert not list(tmp_path.glob(".*tmp*"))  # written atomically, nothing left behind


def test_plot_gpu_hours_without_them_is_refused(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "runs" / "plain"
    run_dir.mkdir(parents=True)
    lines = [{"event": "train", "time": 1.0, "step": 1, "loss": 3.0, "tokens": 100}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = tmp_path / "p.png"
    code, _, err = run_report(
        capsys, str(tmp_path / "runs"), "--plot", str(out), "--x", "gpu_hours"
    )
    assert code == 2 and "log no gpu_hours" in err and not out.exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_report_over_real_runs_live_and_finished(
    tmp_path: Path, char_dataset: Path, capsys
) -> None:
    """A real run while it trains (``running``), after a preemption, and a finished one."""
    runs = tmp_path / "runs"
    done_cfg = write_config(
        tmp_path / "done.yaml", tiny_overrides(char_dataset, runs, run__name="done")
    )
    res = run_nanolab("fit", "--config", str(done_cfg), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    live_cfg = write_config(
        tmp_path / "live.yaml",
        tiny_overrides(char_dataset, runs, run__name="live", trainer__max_steps=5000),
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "nanolab", "fit", "--config", str(live_cfg)],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        log = runs / "live" / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while len(read_records(log, "train")) < 5:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        code, out, err = run_report(capsys, str(runs), "--json")
        assert code == 0, err
        runs_by_name = {r["run"]: r for r in json.loads(out)["runs"]}
        live, done = runs_by_name["live"], runs_by_name["done"]
        assert live["status"] == "running" and live["steps"] >= 5 and live["train_loss"] > 0
        assert done["status"] == "completed" and done["steps"] == 6
        assert done["best_val_loss"] is not None and done["tokens"] == 6 * 4 * 32
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 75
    finally:
        if proc.poll() is None:
            proc.kill()
    code, out, _ = run_report(capsys, str(runs), "--run", "live")
    assert code == 0 and "preempted" in out.splitlines()[2]


def test_an_option_added_later_with_a_null_default_does_not_split_a_group(tmp_path: Path) -> None:
    """Seeds queued across a nanolab upgrade: one log's config has a new key set to null."""
    from nanolab.report import seed_groups

    a = write_run(tmp_path, "x-s1", seed=1, losses=[3.0], vals={1: 2.5})
    write_run(tmp_path, "x-s2", seed=2, losses=[3.0], vals={1: 2.7})
    lines = (a / "metrics.jsonl").read_text().splitlines()
    start = json.loads(lines[0])
    start["config"]["run"]["micro_batch_size"] = None
    (a / "metrics.jsonl").write_text("\n".join([json.dumps(start), *lines[1:]]) + "\n")
    (group,) = seed_groups([summarize_run(n, tmp_path / n) for n in ("x-s1", "x-s2")])
    assert group.n == 2 and group.mean_val_loss == pytest.approx(2.6)


def test_a_key_only_newer_logs_carry_does_not_split_a_group(tmp_path: Path) -> None:
    """Seeds queued across an upgrade that added model.gpt.norm (default layernorm): seen live,
    a 3-seed queue split in two by the report."""
    from nanolab.report import seed_groups

    a = write_run(tmp_path, "x-s1", seed=1, losses=[3.0], vals={1: 2.5})
    write_run(tmp_path, "x-s2", seed=2, losses=[3.0], vals={1: 2.7})
    write_run(tmp_path, "y-s1", seed=1, lr=0.001, losses=[3.0], vals={1: 2.9})
    lines = (a / "metrics.jsonl").read_text().splitlines()
    start = json.loads(lines[0])
    start["config"]["model"]["gpt"]["norm"] = "layernorm"
    (a / "metrics.jsonl").write_text("\n".join([json.dumps(start), *lines[1:]]) + "\n")
    summaries = [summarize_run(n, tmp_path / n) for n in ("x-s1", "x-s2", "y-s1")]
    (group,) = seed_groups(summaries)
    assert group.runs == ["x-s1", "x-s2"] and group.label == "lr=0.003"  # norm is no difference


def _set_data(run_dir: Path, dataset_dir: str, vocab: int) -> None:
    """Give a hand-written run another dataset (its start record's config)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    start = json.loads(lines[0])
    start["config"]["data"] = {"dataset_dir": dataset_dir}
    start["config"]["model"]["gpt"]["vocab_size"] = vocab
    (run_dir / "metrics.jsonl").write_text("\n".join([json.dumps(start), *lines[1:]]) + "\n")


def test_plot_one_colour_per_group_mean_and_band_on_the_newest_runs_data(tmp_path, capsys):
    t0 = time.time() - 500
    vals = {"a-s1": (3.0, 2.0), "a-s2": (3.2, 2.4), "a-s3": (3.1, 2.2), "b-s1": (2.9, 1.9)}
    for i, (name, (v1, v2)) in enumerate(vals.items()):
        lr = 0.003 if name.startswith("a") else 0.001
        write_run(tmp_path, name, seed=i + 1, lr=lr, losses=[4.0, 3.5, 3.0, 2.5],
                  vals={2: v1, 4: v2}, t0=t0 + i)  # fmt: skip
    other = write_run(tmp_path, "bpe", losses=[9.0, 8.0], vals={2: 7.5}, t0=t0 - 100)
    _set_data(other, "data/bpe", 8192)
    from nanolab.report import default_plot_selection, plot_runs, summarize_run

    summaries = [summarize_run(n, tmp_path / n) for n in [*vals, "bpe"]]
    kept, left_out = default_plot_selection(summaries)
    assert sorted(s.run for s in kept) == sorted(vals) and left_out == 1
    drawn = plot_runs([(s, tmp_path / s.run) for s in kept], tmp_path / "p.png", "tokens")
    assert [(d["label"], d["runs"]) for d in drawn] == [
        ("lr=0.003", ["a-s1", "a-s2", "a-s3"]), ("lr=0.001", ["b-s1"])]  # fmt: skip
    assert len({d["color"] for d in drawn}) == 2
    # the val band of group a at step 4 (4000 tokens): mean and its 95% interval over its three
    # seeds (2.0, 2.4, 2.2: sd 0.2; Student t at 2 degrees of freedom, 4.3027)
    x, mean, lo, hi = drawn[0]["val_band"][-1]
    half = 4.302652729911275 * 0.2 / 3**0.5
    assert x == 4000 and mean == pytest.approx(2.2)
    assert (lo, hi) == (pytest.approx(2.2 - half), pytest.approx(2.2 + half))
    code, out, _ = run_report(capsys, str(tmp_path), "--plot", str(tmp_path / "q.png"), "--logx")
    assert code == 0 and (tmp_path / "q.png").stat().st_size > 10_000
    assert "4 runs on the newest run's data; 1 on other data left out" in out
    # The footnote states the rule the figure follows: with 10 or fewer logged losses the
    # mean leaves the first out (it said "the last 10 logged steps", which holds the first).
    flat = " ".join(out.split())
    assert (
        "Δ train loss: mean training loss of the last 10 logged steps after the first (all of "
        "them when fewer) minus the first logged step's" in flat
    )


def test_tokens_axis_reads_in_k_m_b() -> None:
    from nanolab.report.plot import _tokens_axis

    assert [_tokens_axis(v) for v in (500, 2e4, 1.5e6, 2e9)] == ["500", "20k", "1.5M", "2B"]


def test_a_repeated_seed_counts_once_and_leaves_its_group_untested(tmp_path, capsys) -> None:
    """docs/forking.md's ``queue add runs/smoothed/config.yaml`` once repeated the run's own
    seed: two runs of one seed, n=2 with zero spread, and a Welch test and a power estimate
    against another group. One seed is one sample: n=1, "not tested", the repeat named.

    Mutations caught: the repeat counted (a test over a spread of zero); the first run to
    finish not the one kept."""
    t0 = time.time() - 1000
    write_run(tmp_path, "x-a", seed=7, losses=[3.0], vals={1: 2.5}, t0=t0)
    write_run(tmp_path, "x-b", seed=7, losses=[3.0], vals={1: 2.5}, t0=t0 + 100)
    write_run(tmp_path, "y-s1", seed=1, lr=0.001, losses=[3.0], vals={1: 2.7}, t0=t0)
    write_run(tmp_path, "y-s2", seed=2, lr=0.001, losses=[3.0], vals={1: 2.8}, t0=t0)
    code, out, _ = run_report(capsys, str(tmp_path))
    assert code == 0
    assert "(n=1, seeds 7: x-a, x-b)" in out
    assert "left out of the statistics: x-b (seed 7 again, as x-a: counted once)" in out
    assert "Welch" not in out.split("differences", 1)[1].split("\n", 1)[1], out
    assert "lr=0.003 vs lr=0.001: not tested, lr=0.003 has 1 usable seed of 2" in out
    code, out, _ = run_report(capsys, str(tmp_path), "--json")
    data = json.loads(out)
    assert data["comparisons"] == []
    (group,) = [g for g in data["seed_groups"] if g["runs"] == ["x-a", "x-b"]]
    assert (group["n"], group["val_losses"], group["repeated_seeds"]) == (1, [2.5], [7])


def test_a_seed_crashed_early_then_run_to_the_end_is_read_at_its_end(tmp_path, capsys) -> None:
    """Seed 1 crashed at step 3, then ran again to the end beside seeds 2 and 3. The crashed
    copy, first by time, stood for seed 1: the group was read at its 3 steps' tokens (the
    most every "seed" validated at) and the header said "seeds 1,1,2,3".

    Mutations caught: the earliest run kept whatever its state; a crashed copy preferred to a
    completed one with fewer tokens; the seeds list printing a repeat."""
    t0 = time.time() - 1000
    losses = [3.0, 2.9, 2.8, 2.7, 2.6, 2.5]
    write_run(tmp_path, "a-s1-crashed", seed=1, losses=losses[:3], vals={3: 2.9}, end=None, t0=t0)
    for seed, last in ((1, 2.0), (2, 2.1), (3, 1.9)):
        write_run(tmp_path, f"a-s{seed}", seed=seed, losses=losses, vals={3: 2.9, 6: last},
                  t0=t0 + 100)  # fmt: skip
    code, out, _ = run_report(capsys, str(tmp_path))
    assert code == 0
    assert "2.0000 ± 0.2484 at 6,000 tokens  (n=3, seeds 1,2,3: a-s1, a-s1-crashed" in out, out
    assert "left out of the statistics: a-s1-crashed (seed 1 again, as a-s1: counted once)" in out

    from nanolab.report.groups import repeats
    from nanolab.runs import RunSummary

    done = RunSummary(run="done", status="completed", tokens=10, seed=1, updated=5.0)
    budget = RunSummary(run="budget", status="budget", tokens=99, seed=1, updated=1.0)
    assert repeats([budget, done]) == {"budget": "done"}  # completed first, whatever its tokens
    again = RunSummary(run="again", status="completed", tokens=10, seed=1, updated=9.0)
    assert repeats([again, done]) == {"again": "done"}  # a tie: the first to finish


def test_compare_prints_the_config_diff_beside_the_results(tmp_path, capsys) -> None:
    write_run(tmp_path, "lo", seed=1, lr=0.001, losses=[4.0, 3.0], vals={2: 2.9})
    write_run(tmp_path, "hi", seed=2, lr=0.003, losses=[4.0, 2.5], vals={2: 2.4})
    code, out, err = run_report(capsys, str(tmp_path), "--compare", "lo", "hi")
    assert code == 0, err
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()}
    assert rows["model.optimizer.lr"] == ["0.001", "0.003"]
    assert rows["seed_everything"] == ["1", "2"] and rows["run.name"] == ["lo", "hi"]
    assert "trainer.max_steps" not in rows  # equal in both: not shown
    assert out.splitlines()[0].split() == ["config", "lo", "hi"]
    assert re.search(r"^final val loss +2\.9000 +2\.4000$", out, re.M)
    assert re.search(r"^status +completed +completed$", out, re.M)
    code, _, err = run_report(capsys, str(tmp_path), "--compare", "lo", "nope")
    assert code == 2 and "--compare: no run named 'nope'" in err


def test_compare_keeps_a_multi_line_value_on_its_row(tmp_path, capsys) -> None:
    """A data template with a line break printed over two lines, and the table dropped the
    blank line before ``result`` (its row then had no height)."""
    write_run(tmp_path, "plain", seed=1, losses=[4.0, 3.0], vals={2: 2.9})
    run_dir = write_run(tmp_path, "records", seed=1, losses=[4.0, 3.0], vals={2: 2.9})
    log = run_dir / "metrics.jsonl"
    start, *rest = log.read_text().splitlines()
    record = json.loads(start)
    record["config"].setdefault("data", {})["template"] = "Q: {question}\nA: {answer}"
    log.write_text("\n".join([json.dumps(record), *rest]) + "\n")
    code, out, err = run_report(capsys, str(tmp_path), "--compare", "plain", "records")
    assert code == 0, err
    assert re.search(r'^data\.template +\(unset\) +"Q: \{question\}\\nA: \{answer\}"$', out, re.M)
    lines = out.splitlines()
    assert lines[lines.index("result") - 1] == "", out


def _add_tasks(run_dir: Path, step: int, cloze: float, core: float) -> None:
    """Append a ``tasks`` record as the downstream callback writes it."""
    record = {"event": "tasks", "time": time.time(), "step": step, "suite": "builtin:shakespeare",
              "tasks/cloze/score": cloze, "tasks/cloze/acc": 0.3, "tasks/cloze/centered": core,
              "tasks/cloze/n": 100, "tasks/core": core}  # fmt: skip
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")


def test_task_accuracies_columns_seed_groups_and_plot(tmp_path: Path, capsys) -> None:
    """The newest tasks record of each run: CORE and per-task columns, CORE's mean ± std per
    seed group, and a panel per task metric in the plot."""
    cores = {"s1": 0.10, "s2": 0.16, "s3": 0.13}
    for i, (name, core) in enumerate(cores.items(), start=1):
        run = write_run(tmp_path / "runs", name, seed=i, losses=[3.0, 2.8], vals={2: 2.5})
        _add_tasks(run, 1, 0.2, -0.5)  # an earlier evaluation: not the one reported
        _add_tasks(run, 2, 0.25 + 0.75 * core, core)
    code, out, _ = run_report(capsys, str(tmp_path / "runs"), "--json")
    assert code == 0
    data = json.loads(out)
    assert {r["run"]: r["core"] for r in data["runs"]} == cores
    assert data["runs"][0]["task_scores"] == {"cloze": pytest.approx(0.25 + 0.75 * 0.10)}
    (group,) = data["seed_groups"]
    assert group["mean_core"] == pytest.approx(statistics.fmean(cores.values()))
    assert group["std_core"] == pytest.approx(statistics.stdev(cores.values()))
    _, table, _ = run_report(capsys, str(tmp_path / "runs"))
    header = next(line for line in table.splitlines() if line.startswith("run  from"))
    assert header.split()[-3:] == ["suite", "centered", "cloze"]  # Shakespeare's is no CORE
    assert "+0.100" in table and f"{0.25 + 0.75 * 0.10:.3f}" in table
    mean, std = statistics.fmean(cores.values()), statistics.stdev(cores.values())
    assert f"shakespeare centered {mean:+.3f} ± {std:.3f}" in table and "CORE +" not in table
    out_png = tmp_path / "plot.png"
    code, _, err = run_report(capsys, str(tmp_path / "runs"), "--plot", str(out_png))
    assert code == 0, err
    width, height = (int.from_bytes(out_png.read_bytes()[i : i + 4], "big") for i in (16, 20))
    assert (width, height) == (3 * 720, 2 * 576)  # train, val, CORE, cloze: 3 x 2 panels


def test_the_legend_stays_inside_the_figure_with_many_groups(tmp_path, monkeypatch) -> None:
    """Eight groups (eight learning rates, two seeds each): the legend's box lies inside the
    saved figure, not off its edges."""
    import matplotlib.pyplot as plt

    from nanolab.report import plot_runs, summarize_run

    kept = []
    monkeypatch.setattr(plt, "close", lambda fig=None: kept.append(fig))
    names = []
    for i, lr in enumerate([1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2]):
        for seed in (1, 2):
            name = f"lr{lr:g}-s{seed}"
            write_run(tmp_path, name, seed=seed, lr=lr, losses=[4.0, 3.0 - i / 10], vals={2: 2.5})
            names.append(name)
    summaries = [summarize_run(n, tmp_path / n) for n in names]
    drawn = plot_runs([(s, tmp_path / s.run) for s in summaries], tmp_path / "p.png", "tokens")
    assert len(drawn) == 8
    (fig,) = kept
    renderer = fig.canvas.get_renderer()
    (legend,) = fig.legends
    box, page = legend.get_window_extent(renderer), fig.bbox
    assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1


def test_a_validate_appended_after_training_is_not_the_runs_best(tmp_path: Path) -> None:
    """``nanolab validate`` appends a val record (``evaluated_by``) after training; the
    report's best and final val loss stay those of training, the step ``--ckpt_path best``
    also takes (a second reader found them disagreeing: 310 vs 300)."""
    from nanolab.runs import summarize_run

    run = tmp_path / "r"
    run.mkdir()
    records = [
        {"event": "start", "time": 0.0, "step": 0, "run_id": "x"},
        {"event": "val", "time": 1.0, "step": 300, "tokens": 3000, "val_loss": 2.5175},
        {"event": "end", "time": 2.0, "step": 300, "reason": "completed"},
        {"event": "val", "time": 3.0, "step": 310, "tokens": 3100, "val_loss": 2.5165,
         "evaluated_by": "nanolab validate"},
    ]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    s = summarize_run("r", run)
    assert (s.best_val_loss, s.best_val_step, s.final_val_loss) == (2.5175, 300, 2.5175)
    # ... and the validate's value is kept apart, labelled by where it came from
    assert (s.evaluated_val_loss, s.evaluated_val_step) == (2.5165, 310)
    code = main([str(run)])
    assert code == 0
    from nanolab.report import validated_table

    lines = validated_table([s])
    assert "val loss (nanolab validate)" in lines[1] and "2.5165" in "".join(lines)


def test_a_group_label_names_a_key_unambiguously_among_all_of_the_configs_keys() -> None:
    """Groups that differ in ``checkpoint.every_n_steps`` while every config also has
    ``log.every_n_steps`` are labelled ``checkpoint.every_n_steps=...``: ``every_n_steps=``
    alone did not say which (a second reader's finding)."""
    from nanolab.report.groups import _short_keys

    keys = ["checkpoint.every_n_steps", "log.every_n_steps", "model.optimizer.lr"]
    short = _short_keys(["checkpoint.every_n_steps", "model.optimizer.lr"], keys)
    assert short == {"checkpoint.every_n_steps": "checkpoint.every_n_steps",
                     "model.optimizer.lr": "lr"}  # fmt: skip


def test_the_plotted_train_curve_is_the_trailing_mean_of_its_window() -> None:
    import random

    from nanolab.report.plot import _curve

    rng = random.Random(0)
    records = [{"step": s, "tokens": 10 * s, "loss": rng.uniform(1, 5)} for s in range(1, 300)]
    records.insert(50, {"step": "x", "tokens": 1, "loss": 1.0})  # skipped, not averaged
    losses = [r["loss"] for r in records if isinstance(r["step"], int)]
    for smooth in (1, 7, 40):
        curve = _curve(records, "tokens", "loss", {}, smooth=smooth)
        for i, step in enumerate(range(1, 300)):
            window = losses[max(0, i - smooth + 1) : i + 1]
            assert curve[step][0] == 10 * step
            assert curve[step][1] == pytest.approx(statistics.fmean(window), rel=1e-12)


def test_a_log_of_bytes_that_hold_no_record_is_not_called_empty(tmp_path: Path) -> None:
    run = tmp_path / "b"
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(bytes(range(1, 256)) * 100)
    s = summarize_run("b", run)
    assert (s.status, s.detail) == (
        "crashed", "no readable record in its log (25,500 bytes: damaged, or not a run log)"
    )  # fmt: skip
    (run / "metrics.jsonl").write_bytes(b"")
    assert summarize_run("b", run).detail == "empty log"


@pytest.mark.parametrize(
    ("names", "label"),
    [
        (["qs600"], "qs600"),  # docs/queue.md's job: its legend read "q"
        (["records"], "records"),
        (["class"], "class"),
        (["qs60-s1"], "qs60"),
        (["qs60-s1", "qs60-s2", "qs60-s3"], "qs60"),
        (["lr_seed1", "lr_seed2"], "lr"),
        (["a-s1", "a-s12"], "a"),
        (["cpu_check-20261205-121530", "cpu_check-20261205-121702"], "cpu_check-20261205"),
        (["records", "records2"], "records, records2"),
        (["run-a", "run-b"], "run"),
    ],
)
def test_a_label_drops_a_seed_suffix_only(names: list[str], label: str) -> None:
    """Labels of runs (legends, seed groups) lost any trailing "s" or "s<digits>": qs600 became
    q, records record. Only a separated seed suffix goes, and a common part is cut at a
    separator."""
    from nanolab.report.groups import name_label

    assert name_label(names) == label


def test_one_dataset_named_relative_absolute_or_copied_is_the_same_data(tmp_path) -> None:
    """Runs compare by what their data holds (the start record's ``data_identity``), not by
    ``data.dataset_dir`` as written: ``data`` and its absolute path, or a byte-identical copy,
    were "other data" (not compared, --baseline refused). A log without the identity (an
    older one) is keyed on the folder as configured; other content is other data."""
    from nanolab.report.groups import data_key, data_text

    def run(name: str, where: str, identity: str | None) -> Any:
        run_dir = write_run(tmp_path, name, losses=[3.0], vals={1: 2.9})
        _set_data(run_dir, where, 71)
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        start = json.loads(lines[0])
        start["data_identity"] = identity
        (run_dir / "metrics.jsonl").write_text("\n".join([json.dumps(start), *lines[1:]]) + "\n")
        return summarize_run(name, run_dir)

    rel, absolute = run("rel", "data", "abc"), run("abs", str(tmp_path / "data"), "abc")
    copy, other = run("copy", "copy", "abc"), run("other", "data", "def")
    assert data_key(rel) == data_key(absolute) == data_key(copy) != data_key(other)
    assert data_text(absolute) == f"{tmp_path / 'data'}, vocab 71"  # shown as configured
    old_rel, old_abs = run("old-rel", "data", None), run("old-abs", str(tmp_path / "data"), None)
    assert data_key(old_rel) != data_key(old_abs)


def test_a_run_logs_the_identity_of_what_its_data_holds(tmp_path) -> None:
    """Two folders of the same bytes give one identity; other bytes another."""
    import shutil

    from nanolab.data.checks import content_identity, fingerprint

    def identity(folder: Path) -> str | None:
        return content_identity({"datasets": [{"path": str(folder), **fingerprint(folder)}]})

    a = tmp_path / "a"
    a.mkdir()
    for split in ("train", "val"):
        (a / f"{split}.bin").write_bytes(bytes(range(200)))
    (a / "meta.json").write_text('{"vocab_size": 256}')
    shutil.copytree(a, tmp_path / "b")
    assert identity(a) == identity(tmp_path / "b") is not None
    (tmp_path / "b" / "val.bin").write_bytes(bytes(range(1, 201)))
    assert identity(a) != identity(tmp_path / "b")


def _with_data(run_dir: Path, where: str, identity: str | None) -> Path:
    """A hand-written run on the dataset ``where`` whose content is ``identity``."""
    _set_data(run_dir, where, 71)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    start = json.loads(lines[0])
    start["data_identity"] = identity
    (run_dir / "metrics.jsonl").write_text("\n".join([json.dumps(start), *lines[1:]]) + "\n")
    return run_dir


def test_seeds_on_one_dataset_named_two_ways_are_one_group(tmp_path: Path, capsys) -> None:
    """The seed groups key on what the data holds, as the comparisons do: seeds given ``data``,
    its absolute path and a copy were three configs (no group at all, or a group per name,
    labelled ``dataset_dir=...``). Older logs without the identity keep the folder as written;
    one folder prepared again in place for other content is labelled apart by its content."""
    for seed, where in enumerate(("data", str(tmp_path / "data"), "copy"), start=1):
        run_dir = write_run(tmp_path / "runs", f"a-s{seed}", seed=seed, losses=[3.0],
                            vals={1: 2.5 + seed / 100})  # fmt: skip
        _with_data(run_dir, where, "abc")
    for seed in (1, 2):
        run_dir = write_run(tmp_path / "runs", f"b-s{seed}", seed=seed, lr=0.01, losses=[3.0],
                            vals={1: 2.7 + seed / 100})  # fmt: skip
        _with_data(run_dir, "data", "abc")
    code, out, _ = run_report(capsys, str(tmp_path / "runs"), "--json")
    assert code == 0
    groups = {g["label"]: g["runs"] for g in json.loads(out)["seed_groups"]}
    assert groups == {"lr=0.003": ["a-s1", "a-s2", "a-s3"], "lr=0.01": ["b-s1", "b-s2"]}
    assert len(json.loads(out)["comparisons"]) == 1

    old = tmp_path / "old"  # logs from before the identity: the folder as configured
    for seed, where in enumerate(("data", "data", "/abs/data"), start=1):
        _with_data(write_run(old, f"o-s{seed}", seed=seed, losses=[3.0], vals={1: 2.5}),
                   where, None)  # fmt: skip
    _, out, _ = run_report(capsys, str(old), "--json")
    assert [(g["label"], g["runs"]) for g in json.loads(out)["seed_groups"]] == [
        ("dataset=data", ["o-s1", "o-s2"])
    ]

    again = tmp_path / "again"  # "data" prepared anew between the groups: other content
    for name, identity in (("x-s1", "abc"), ("x-s2", "abc"), ("y-s1", "def"), ("y-s2", "def")):
        _with_data(write_run(again, name, seed=int(name[-1]), losses=[3.0], vals={1: 2.5}),
                   "data", identity)  # fmt: skip
    _, out, _ = run_report(capsys, str(again), "--json")
    assert sorted(g["label"] for g in json.loads(out)["seed_groups"]) == [
        "dataset=data (content abc)", "dataset=data (content def)"
    ]  # fmt: skip


def _saved_on(run_dir: Path, fingerprint: dict[str, Any]) -> None:
    """A checkpoint file in ``run_dir`` whose DataModule state holds ``fingerprint``, as every
    nanolab checkpoint does (no weights: only the data record is read)."""
    import torch

    (run_dir / "checkpoints").mkdir(exist_ok=True)
    state = {"TokenDataModule": {"data_fingerprint": fingerprint, "align": "stream"}}
    torch.save(state, run_dir / "checkpoints" / "step-00000001.ckpt")


def test_a_sweep_straddling_the_data_identity_stays_one_group(tmp_path: Path, capsys) -> None:
    """Seeds logged before the start record carried ``data_identity`` and seeds logged after,
    on one data, are one group compared with the other config: an older log's identity is
    read from its checkpoint's data record (what it trained on). A folder of the same name
    that held other text (another project's, or prepared again) is other data: the older runs
    are neither grouped with the newer nor compared with them."""
    from nanolab.data.checks import content_identity

    def fingerprint(sample: str) -> dict[str, Any]:
        prints = {"meta_sha256": sample, "train.bin": 100, "val.bin": 10}
        return {"version": 1, "datasets": [{"name": "d", "path": "data", "weight": 1.0, **prints}]}

    same, other = fingerprint("aaa"), fingerprint("bbb")
    identity = content_identity(same)
    runs = tmp_path / "runs"
    for seed, logged in ((1, None), (2, identity), (3, identity)):
        run_dir = _with_data(write_run(runs, f"a-s{seed}", seed=seed, losses=[3.0],
                                       vals={1: 2.5 + seed / 100}), "data", logged)  # fmt: skip
        _saved_on(run_dir, same)
    for seed, logged in ((1, None), (2, identity)):
        run_dir = _with_data(write_run(runs, f"b-s{seed}", seed=seed, lr=0.01, losses=[3.0],
                                       vals={1: 2.7 + seed / 100}), "data", logged)  # fmt: skip
        _saved_on(run_dir, same)
    code, out, _ = run_report(capsys, str(runs), "--json")
    assert code == 0
    groups = {g["label"]: g["runs"] for g in json.loads(out)["seed_groups"]}
    assert groups == {"lr=0.003": ["a-s1", "a-s2", "a-s3"], "lr=0.01": ["b-s1", "b-s2"]}
    assert len(json.loads(out)["comparisons"]) == 1

    elsewhere = tmp_path / "elsewhere"  # "data" of another project: older logs, other text
    for seed in (1, 2):
        run_dir = _with_data(write_run(elsewhere, f"o-s{seed}", seed=seed, lr=0.03,
                                       losses=[3.0], vals={1: 2.6}), "data", None)  # fmt: skip
        _saved_on(run_dir, other)
    _, out, _ = run_report(capsys, str(runs), str(elsewhere), "--json")
    report = json.loads(out)
    labels = [g["label"] for g in report["seed_groups"]]
    assert len(labels) == 3 and sum("lr=0.03" in label for label in labels) == 1, labels
    tested = {tuple(sorted((c["a"], c["b"]))) for c in report["comparisons"]}
    assert len(tested) == 1 and all("0.03" not in side for side in next(iter(tested))), tested


def test_a_runs_validations_are_held_packed_for_the_tables_and_the_forecast(tmp_path: Path) -> None:
    """A report holds every run's (tokens, val loss) points, and with --forecast every run's
    validations, until it prints: as lists of tuples and dicts they took ~120 and ~340 bytes a
    validation (50 runs x 10^5: 0.6 and 1.6 GB); packed columns take 16 and 24, and give the
    same points (a step validated again on resume counts with its last copy)."""
    import gc
    import tracemalloc

    from nanolab.report.forecasts import ForecastReader

    n = 20_000
    vals = {s: 3.0 - s / (2 * n) for s in range(1, n + 1)}
    run_dir = write_run(tmp_path, "long", losses=[3.0] * n, vals=vals)
    reader = ForecastReader()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        s = summarize_run("long", run_dir, also=reader.add)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held / n < 60, f"{held / n:.0f} bytes a validation"
    assert list(s.val_points) == [(1000 * k, v) for k, v in vals.items()]
    assert s.val_points == [(1000 * k, v) for k, v in vals.items()] and len(s.val_points) == n
    points = reader.inputs(run_dir).points
    assert points == [(float(k), 1000.0 * k, v) for k, v in vals.items()]
    again = ForecastReader()
    for r in ({"event": "val", "step": 5, "tokens": 50, "val_loss": 2.0},
              {"event": "val", "step": 6, "tokens": 60, "val_loss": 1.9},
              {"event": "val", "step": 5, "tokens": 50, "val_loss": 2.1},  # resumed: last copy
              {"event": "val", "step": 6, "tokens": 0, "val_loss": 1.8}):  # fmt: skip
        again.add(r)
    assert again.val.points() == [(5.0, 50.0, 2.1)]


def test_the_report_of_one_run_does_not_import_scipy(tmp_path: Path) -> None:
    """A group of one run has no interval: scipy (~1 s of a 0.06 s report) is not imported for
    it. It was, before the interval's value count was looked at."""
    write_run(tmp_path / "runs", "solo", losses=[3.0, 2.5, 2.2, 2.0], vals={2: 2.6, 4: 2.1})
    probe = (
        "import sys; from nanolab.cli import main; code = main(['report', sys.argv[1]]); "
        "print('RESULT', code, 'scipy' in sys.modules)"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "runs")], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "solo" in out.stdout
    assert out.stdout.splitlines()[-1].split() == ["RESULT", "0", "False"], out.stdout
