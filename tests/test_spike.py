"""Finite loss spikes: detection, the data a rollback skips, and a poisoned run healed."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import (
    QUICKSTART,
    REPO,
    nanolab_here,
    run_nanolab,
    tiny_overrides,
    write_config,
)

from nanolab.callbacks.events import CallbackConfigError
from nanolab.callbacks.spike import SpikeGuard, complete_rollback
from nanolab.data.skips import data_position, jumps, read_ledger, write_ledger
from nanolab.data.windows import ResumableBatchSampler, WindowPlan
from nanolab.runlog import read_records
from nanolab.runs import current_timeline, summarize_run


def feed(guard: SpikeGuard, losses: list[float]) -> list[tuple[int, str]]:
    """(step, action) wherever the guard acts, steps counted from 1."""
    out = []
    for step, loss in enumerate(losses, start=1):
        action = guard.observe(None, step, loss)
        if action is not None:
            out.append((step, action))
    return out


def healthy(steps: int, seed: int, start: float = 4.3, end: float = 1.8, noise: float = 0.08):
    """A falling loss with batch noise, as a healthy run logs it."""
    rng = random.Random(seed)
    return [end + (start - end) * math.exp(-i / 80) + rng.gauss(0, noise) for i in range(steps)]


def test_healthy_and_converging_losses_never_fire() -> None:
    for seed in range(5):
        assert feed(SpikeGuard(), healthy(600, seed)) == []
        # Nearly converged (overfitting a batch): 0.05 with noise never counts as a spike.
        assert feed(SpikeGuard(), healthy(600, seed, start=3.0, end=0.03, noise=0.02)) == []


def test_a_spike_fires_after_patience_steps_and_single_outliers_do_not() -> None:
    losses = healthy(200, 0)
    for i in (100, 130, 131):  # one and two noisy batches: below patience
        losses[i] *= 3
    assert feed(SpikeGuard(), losses) == []
    losses[150:170] = [9.0] * 20
    assert feed(SpikeGuard(patience=5), losses) == [(155, "rollback")]
    warn = SpikeGuard(action="warn", patience=5)
    assert feed(warn, losses) == [(155, "warn")]  # once per spike, not at every high step


def test_a_resume_in_the_middle_of_a_spike_fires_at_the_same_step(tmp_path: Path) -> None:
    """The run of high steps in progress is part of the checkpoint: a run killed at step 152 of
    a spike that began at 151 and resumed from that step's checkpoint fires at 155, as the
    uninterrupted run does (it had fired at 156 and rolled back to other data); a warn-only
    spike already reported is not reported again after a resume."""
    import torch

    losses = healthy(200, 0)
    losses[150:170] = [9.0] * 20

    def resumed_at(step: int, **kwargs: object) -> list[tuple[int, str]]:
        before = SpikeGuard(patience=5, **kwargs)
        fired = feed(before, losses[:step])
        path = tmp_path / "callback_state.pt"
        torch.save(before.state_dict(), path)  # as a checkpoint stores it, loaded the same way
        after = SpikeGuard(patience=5, **kwargs)
        after.load_state_dict(torch.load(path, weights_only=True))
        later = [(step + i, a) for i, a in feed(after, losses[step:])]
        return fired + later

    assert resumed_at(152) == feed(SpikeGuard(patience=5), losses) == [(155, "rollback")]
    assert resumed_at(160, action="warn") == [(155, "warn")]
    old = SpikeGuard(patience=5)
    old.load_state_dict({"history": [2.0] * 20})  # a checkpoint from before: none in progress
    assert old.high.count == 0 and old.fired is False


def test_bad_settings_are_one_line() -> None:
    for kwargs, field in [
        ({"action": "restart"}, "spike.action"),
        ({"factor": 1.0}, "spike.factor"),
        ({"window": 0}, "spike.window"),
        ({"patience": 2.5}, "spike.patience"),
        ({"max_rollbacks": -1}, "spike.max_rollbacks"),
        ({"min_increase": -1}, "spike.min_increase"),
    ]:
        with pytest.raises(CallbackConfigError, match=field):
            SpikeGuard(**kwargs)


def test_jumps_skip_data_and_a_later_rollback_replaces_what_it_abandons(tmp_path: Path) -> None:
    assert read_ledger(tmp_path) == []
    write_ledger(tmp_path, [{"skip_at": 40, "skip_offset": 8}])
    first = jumps(read_ledger(tmp_path))
    assert [data_position(k, first) for k in (0, 39, 40, 41)] == [0, 39, 48, 49]
    # A second rollback to micro-batch 30 (before the first one's jump) abandons that jump.
    second = jumps([{"skip_at": 40, "skip_offset": 8}, {"skip_at": 30, "skip_offset": 25}])
    assert [data_position(k, second) for k in (29, 30, 40)] == [29, 55, 65]
    plan = WindowPlan(num_tokens=20_000, block_size=16, micro_batch_size=2, world_size=1, seed=3)
    resumed = iter(ResumableBatchSampler(plan, rank=0, start=40, jumps=first))
    assert (next(resumed) == plan.batch_starts(48, 0)).all()


def test_complete_rollback_repoints_last_and_moves_newer_checkpoints(tmp_path: Path) -> None:
    """A rollback killed after its ledger entry is finished on the next start: last.ckpt is
    the checkpoint rolled back to, newer ones are kept in rolled_back/, and it is idempotent."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for step in (10, 20, 30):
        (folder / f"step-{step:08d}.ckpt").write_text(str(step))
    (folder / "last.ckpt").hardlink_to(folder / "step-00000030.ckpt")
    entry = {"restored": 10, "checkpoint": str(folder / "step-00000010.ckpt"), "state": "pending"}
    write_ledger(tmp_path, [{**entry, "skip_at": 10, "skip_offset": 5}])
    complete_rollback(tmp_path)
    assert (folder / "last.ckpt").read_text() == "10"
    assert sorted(p.name for p in (folder / "rolled_back").iterdir()) == [
        "step-00000020.ckpt",
        "step-00000030.ckpt",
    ]
    assert read_ledger(tmp_path)[-1]["state"] == "done"
    (folder / "step-00000020.ckpt").write_text("new timeline")
    complete_rollback(tmp_path)  # done: the new timeline's files stay where they are
    assert (folder / "step-00000020.ckpt").read_text() == "new timeline"


def poisoned_config(tmp: Path, char_dataset: Path, name: str, **extra: object) -> Path:
    """120 steps of the tiny model, a checkpoint every 10, the guard on a 20-step window."""
    cfg = tiny_overrides(char_dataset, tmp / "runs", **extra)
    cfg["trainer"]["max_steps"] = 120
    cfg["run"].update(name=name, eval_every_steps=40)
    cfg["checkpoint"] = {"every_n_steps": 10, "keep_last": 2}
    cfg.setdefault("spike", {}).update(window=20, patience=3)
    return write_config(tmp / f"{name}.yaml", cfg)


def poison(first: int = 58, last: int = 59) -> dict:
    return {
        "class_path": "cli_probes.PoisonedData",
        "init_args": {"first": first, "last": last, "lr_factor": 300.0},
    }


def fit(tmp: Path, config: Path) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """``nanolab fit`` of the quickstart with ``config`` on top; the process and its run log."""
    path = os.pathsep.join([str(REPO), str(REPO / "tests")])  # this checkout's nanolab
    proc = run_nanolab(
        "fit", "--config", str(QUICKSTART), "--config", str(config), cwd=tmp,
        env={"PYTHONPATH": path}, timeout=600,
    )  # fmt: skip
    log = tmp / "runs" / yaml.safe_load(config.read_text())["run"]["name"] / "metrics.jsonl"
    return proc, (list(read_records(log)) if log.exists() else [])


@pytest.mark.slow
def test_a_poisoned_run_rolls_back_skips_the_poison_and_ends_like_a_clean_one(
    tmp_path: Path, char_dataset: Path
) -> None:
    """Side by side: clean; poisoned with the guard (rollback, default); poisoned with
    ``spike.action warn`` (what happened before: it trains on, damaged). The healed run's final
    validation loss is within 0.1 of the clean run's; its log holds the spike record; the
    poisoned micro-batches were trained once (before the rollback), never again."""
    clean_cfg = poisoned_config(tmp_path, char_dataset, "clean")
    healed_cfg = poisoned_config(tmp_path, char_dataset, "healed", trainer__callbacks=[poison()])
    warned_cfg = poisoned_config(
        tmp_path, char_dataset, "warned", trainer__callbacks=[poison()], spike__action="warn"
    )
    runs = {}
    for name, cfg in (("clean", clean_cfg), ("healed", healed_cfg), ("warned", warned_cfg)):
        proc, records = fit(tmp_path, cfg)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = records

    def last_val(records: list[dict]) -> float:
        return [r["val/loss"] for r in records if r.get("event") == "val"][-1]

    spikes = [r for r in runs["healed"] if r.get("event") == "spike"]
    assert len(spikes) == 1 and spikes[0]["action"] == "rollback"
    assert spikes[0]["restored"] <= spikes[0]["began"] - 2
    ends = [r for r in runs["healed"] if r.get("event") == "end"]
    assert [e["reason"] for e in ends] == ["rollback", "completed"]
    assert ends[-1]["step"] == 120
    assert [r for r in runs["clean"] if r.get("event") == "spike"] == []
    ledger = read_ledger(tmp_path / "runs" / "healed")
    assert len(ledger) == 1 and ledger[0]["state"] == "done"
    assert ledger[0]["skip_offset"] > 0
    moved = tmp_path / "runs" / "healed" / "checkpoints" / "rolled_back"
    assert moved.is_dir() and any(moved.iterdir())
    clean, healed, warned = (last_val(runs[n]) for n in ("clean", "healed", "warned"))
    assert abs(healed - clean) < 0.1, (clean, healed, warned)
    # warn only: it trains on, damaged (a damaged model may spike again: how often depends on
    # the machine's float rounding, so the count is not the point)
    warned_actions = [r["action"] for r in runs["warned"] if r.get("event") == "spike"]
    assert warned_actions and set(warned_actions) == {"warn"}
    print(f"final val loss: clean {clean:.4f}, healed {healed:.4f}, warn only {warned:.4f}")
    # The report counts the rollback and reads the healed timeline only (the damaged
    # validation logged before the rollback is not its best or final number).
    summary = summarize_run("healed", tmp_path / "runs" / "healed")
    assert summary.rollbacks == 1 and summary.status == "completed"
    assert summary.final_val_loss == pytest.approx(healed)
    assert all(r["val/loss"] < 4 for r in current_timeline(runs["healed"]) if r["event"] == "val")


def test_docs_name_the_spike_settings() -> None:
    text = (REPO / "docs" / "callbacks.md").read_text()
    for key in ("spike.action", "spike.factor", "spike.window", "spike.patience", "rollbacks.json"):
        assert key in text


@pytest.mark.slow
def test_a_full_disk_exits_74_and_the_rerun_continues_exactly(
    tmp_path: Path, char_dataset: Path
) -> None:
    """A checkpoint write that runs out of space ends the run with one line and exit 74, the
    previous checkpoint and the log intact; rerunning after space is freed resumes from it and
    ends with the weights of a run that never stopped."""
    import torch

    straight = poisoned_config(tmp_path, char_dataset, "straight")
    full = poisoned_config(
        tmp_path, char_dataset, "full",
        trainer__callbacks=[{"class_path": "cli_probes.DiskFullFrom", "init_args": {"step": 25}}],
    )  # fmt: skip
    proc, _ = fit(tmp_path, straight)
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc, records = fit(tmp_path, full)
    assert proc.returncode == 74, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert (
        len(lines) == 1 and "no space left on device" in lines[0] and "Traceback" not in proc.stderr
    )
    assert records[-1]["event"] == "end" and records[-1]["step"] == 30
    folder = tmp_path / "runs" / "full" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == [
        "last.ckpt",
        "step-00000010.ckpt",
        "step-00000020.ckpt",
    ]
    # Space is back: the same command without the full disk.
    cfg = yaml.safe_load(full.read_text())
    cfg["trainer"].pop("callbacks")
    full.write_text(yaml.safe_dump(cfg))
    proc, records = fit(tmp_path, full)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["resumed_from_step"] for r in records if r["event"] == "start"] == [None, 20]

    def weights(name: str) -> dict:
        path = tmp_path / "runs" / name / "checkpoints" / "last.ckpt"
        return torch.load(path, weights_only=True, map_location="cpu")["state_dict"]

    a, b = weights("straight"), weights("full")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_run_killed_during_its_rollback_resumes_exactly(tmp_path: Path, char_dataset: Path):
    """SIGKILL right after the rollback (ledger written, checkpoints moved, before the
    continuation): rerunning the same command continues from the restored checkpoint with the
    same skipped data, and ends with exactly the weights of the run that was not killed."""
    import torch

    healed = poisoned_config(tmp_path, char_dataset, "healed", trainer__callbacks=[poison()])
    killed = poisoned_config(
        tmp_path, char_dataset, "killed",
        trainer__callbacks=[poison(), {"class_path": "cli_probes.KillOnRollback"}],
    )  # fmt: skip
    proc, _ = fit(tmp_path, healed)
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc, records = fit(tmp_path, killed)
    assert proc.returncode == -9  # killed before its end record: as a lost machine would be
    assert [r["action"] for r in records if r["event"] == "spike"] == ["rollback"]
    assert read_ledger(tmp_path / "runs" / "killed")[-1]["state"] == "done"
    proc, records = fit(tmp_path, killed)
    assert proc.returncode == 0, proc.stderr[-2000:]
    starts = [r["resumed_from_step"] for r in records if r["event"] == "start"]
    assert starts == [None, 50]

    def weights(name: str) -> dict:
        path = tmp_path / "runs" / name / "checkpoints" / "last.ckpt"
        return torch.load(path, weights_only=True, map_location="cpu")["state_dict"]

    a, b = weights("healed"), weights("killed")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_lr_scale_windows() -> None:
    from nanolab.callbacks.spike import lr_windows, scale_at

    windows = lr_windows([{"restored": 50, "lr_scale": 0.5, "lr_scale_steps": 10},
                          {"restored": 80}])  # fmt: skip
    assert windows == [(50, 60, 0.5)]
    assert [scale_at(windows, s) for s in (50, 51, 60, 61)] == [1.0, 0.5, 0.5, 1.0]
    with pytest.raises(CallbackConfigError, match=r"spike\.lr_scale must be"):
        SpikeGuard(lr_scale=1.5)
    with pytest.raises(CallbackConfigError, match=r"spike\.lr_scale_steps"):
        SpikeGuard(lr_scale_steps=-1)


@pytest.mark.slow
def test_after_a_rollback_the_rate_is_scaled_for_a_while(tmp_path: Path, char_dataset: Path):
    """``spike.lr_scale 0.5`` for 10 steps: the optimizer steps after the restored one train at
    half the schedule's rate (the clean run's at the same step), then at the schedule's again;
    the ledger and the spike record say so."""
    probe = {"class_path": "cli_probes.LrAtSteps", "init_args": {"path": str(tmp_path / "c.jsonl")}}
    clean = poisoned_config(tmp_path, char_dataset, "clean", trainer__callbacks=[probe])
    scaled_probe = {**probe, "init_args": {"path": str(tmp_path / "s.jsonl")}}
    scaled = poisoned_config(
        tmp_path, char_dataset, "scaled", trainer__callbacks=[poison(), scaled_probe],
        spike__lr_scale=0.5, spike__lr_scale_steps=10,
    )  # fmt: skip
    for cfg in (clean, scaled):
        proc, _ = fit(tmp_path, cfg)
        assert proc.returncode == 0, proc.stderr[-2000:]

    def rates(name: str) -> dict[int, float]:
        lines = (tmp_path / name).read_text().splitlines()
        return {r["step"]: r["lr"] for r in map(json.loads, lines)}  # the last attempt wins

    a, b = rates("c.jsonl"), rates("s.jsonl")
    (entry,) = read_ledger(tmp_path / "runs" / "scaled")
    restored = entry["restored"]
    assert (entry["lr_scale"], entry["lr_scale_steps"]) == (0.5, 10)
    for step in range(restored + 1, restored + 11):
        assert b[step] == pytest.approx(0.5 * a[step]), step
    for step in range(restored + 11, 121):
        assert b[step] == pytest.approx(a[step]), step


@pytest.mark.parametrize(("every", "keep_last", "patience"), [(1, 2, 3), (1, 1, 1), (2, 2, 6)])
def test_rotation_always_keeps_one_checkpoint_to_roll_back_to(
    tmp_path: Path, every: int, keep_last: int, patience: int
) -> None:
    """A save every step with ``keep_last 2`` and ``patience 3`` kept only the two newest files
    once the run was past its first steps: none was ever old enough to roll back to (the files
    that would have become so were deleted by ``keep_last``), so a spike ended the run as
    diverged. Now from the first save on, one checkpoint at least ``patience + 2`` steps older
    than the newest is kept as soon as such a step was saved, at most two files beyond
    ``keep_last``, the kept one at most twice that far back."""
    from nanolab.callbacks.checkpoint import RotatingCheckpoint

    saver = RotatingCheckpoint(every_n_steps=every, keep_last=keep_last, keep_best=0)
    saver.keep_one_older_than = window = patience + 2
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for step in range(every, 60 * every, every):
        newest = folder / f"step-{step:08d}.ckpt"
        newest.write_bytes(b"x")
        saver._rotate(newest, step, {})
        kept = sorted(int(p.stem.split("-")[1]) for p in folder.iterdir())
        assert len(kept) <= keep_last + 2, (step, kept)
        if step - window >= every:  # a step old enough was saved
            old_enough = [s for s in kept if s <= step - window]
            assert old_enough, (step, kept)
            assert step - max(old_enough) <= 2 * window, (step, kept)


@pytest.mark.slow
def test_a_spike_stop_names_a_checkpoint_from_before_the_spike_to_branch_from(
    tmp_path: Path, char_dataset: Path
) -> None:
    """With a save every step, the diverged line suggested branching "from step 61, its newest
    checkpoint", weights from inside the spike that began at step 60. It names the newest from
    before it now (two steps before, the one a rollback restores), which rotation kept."""
    cfg = poisoned_config(
        tmp_path, char_dataset, "every1", trainer__callbacks=[poison()], spike__action="stop"
    )
    config = yaml.safe_load(cfg.read_text())
    config["checkpoint"] = {"every_n_steps": 1, "keep_last": 2, "keep_best": 0}
    cfg.write_text(yaml.safe_dump(config))
    proc, records = fit(tmp_path, cfg)
    assert proc.returncode == 3, proc.stderr[-2000:]
    (spike,) = [r for r in records if r["event"] == "spike"]
    began = spike["began"]
    line = proc.stderr.strip().splitlines()[-1]
    assert (
        f"from step {began - 2}, its newest checkpoint from before the loss spike that "
        f"began at step {began}" in line
    ), line
    assert (
        f"--run.resume {tmp_path / 'runs' / 'every1' / 'checkpoints'}/step-{began - 2:08d}" in line
    ), line


@pytest.mark.slow
def test_spike_action_stop_ends_as_diverged_with_exit_3_and_saves_nothing_more(
    tmp_path: Path, char_dataset: Path
):
    cfg = poisoned_config(
        tmp_path, char_dataset, "stopped", trainer__callbacks=[poison()], spike__action="stop"
    )
    proc, records = fit(tmp_path, cfg)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "nanolab fit: diverged: loss spike" in proc.stderr
    end = [r for r in records if r["event"] == "end"][-1]
    assert end["reason"] == "diverged" and end["step"] == 62
    saved = sorted(p.name for p in (tmp_path / "runs" / "stopped" / "checkpoints").glob("step-*"))
    assert saved[-1] == "step-00000060.ckpt"  # nothing written from the state it stopped in


def test_a_missing_or_damaged_ledger_is_one_line_before_a_resume(tmp_path: Path) -> None:
    """The data a rollback skipped is part of the run's order: a ledger deleted after a
    rollback, or damaged, refuses the resume with one line naming the file."""
    from nanolab.callbacks.spike import check_ledger
    from nanolab.data.skips import LedgerError

    spike = {"event": "spike", "step": 62, "began": 60, "restored": 50, "action": "rollback"}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(spike) + "\n")
    with pytest.raises(LedgerError, match=r"holds 0 rollback\(s\) but the run log records 1"):
        check_ledger(tmp_path)
    for damage in ("{not json", "[1, 2, 3]", '{"rollbacks": [{"detected": "x"}]}'):
        (tmp_path / "rollbacks.json").write_text(damage)
        with pytest.raises(LedgerError, match=r"rollbacks\.json .*restore it"):
            check_ledger(tmp_path)
    (tmp_path / "rollbacks.json").unlink()
    (tmp_path / "rollbacks.json").mkdir()
    with pytest.raises(LedgerError, match="cannot be read"):
        check_ledger(tmp_path)
    (tmp_path / "rollbacks.json").rmdir()
    write_ledger(tmp_path, [{"restored": 50, "skip_at": 50, "skip_offset": 12}])
    check_ledger(tmp_path)  # complete: fine


def test_the_ledger_check_counts_the_rollbacks_a_line_reader_counts_without_reading_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resume compared the ledger with every spike record, reading the log line by line
    (2-5 s for a 10^6-step log); it searches blocks of bytes now, and counts the same records:
    several launches, warn-only spikes (no ``restored``), a record after a carriage return, an
    escaped event name, a torn last line."""
    import nanolab.runlog as runlog
    from nanolab.callbacks.spike import check_ledger, logged_rollbacks
    from nanolab.data.skips import LedgerError
    from nanolab.runlog import dumps, iter_records

    def spike(step: int, restored: int | None) -> str:
        record = {"event": "spike", "step": step, "began": step - 4, "action": "rollback"}
        return dumps(record if restored is None else {**record, "restored": restored})

    lines = []
    for launch, at in enumerate((0, 300, 700)):
        lines.append(dumps({"event": "start", "time": 0.0, "step": at, "run_id": "r"}))
        for step in range(at + 1, at + 300):
            lines.append(dumps({"event": "train", "time": 1.0, "step": step, "loss": 2.0}))
            if step % 97 == 0:
                lines.append(spike(step, step - 20 if launch else None))
    lines[50] += "\r" + spike(50, 30)  # a carriage return ends a line for the line reader
    lines.append(spike(990, 970).replace('"spike"', '"\\u0073pike"'))
    text = "\n".join(lines) + "\n" + spike(999, 980)[:25]  # torn: killed mid-write
    log = tmp_path / "metrics.jsonl"
    log.write_bytes(text.encode())
    want = sum(1 for r in iter_records(log, "spike") if r.get("restored") is not None)
    assert want == 8
    monkeypatch.setattr(runlog, "iter_numbered", lambda *a, **k: pytest.fail("read by line"))
    assert logged_rollbacks(log) == want
    write_ledger(tmp_path, [{"restored": 1, "skip_at": 1, "skip_offset": 1}] * (want - 1))
    with pytest.raises(LedgerError, match=rf"holds {want - 1} rollback\(s\) .* records {want}"):
        check_ledger(tmp_path)
    write_ledger(tmp_path, [{"restored": 1, "skip_at": 1, "skip_offset": 1}] * want)
    check_ledger(tmp_path)
    assert logged_rollbacks(tmp_path / "none.jsonl") == 0


def test_a_fresh_run_trains_on_its_own_data_order_not_the_old_runs_skips(tmp_path, char_dataset):
    # `run.fresh: true` in a folder whose run rolled back: the ledger goes to previous/ before
    # the data order is built, so the fresh run trains exactly as a run in a clean folder.
    from conftest import nanolab_here

    from nanolab.runlog import read_records

    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=4)
    path = write_config(tmp_path / "c.yaml", cfg)
    fit = ("fit", "--config", str(QUICKSTART), "--config", str(path))
    assert nanolab_here(*fit, cwd=tmp_path).returncode == 0
    write_ledger(tmp_path / "runs" / "tiny", [{"restored": 0, "skip_at": 0, "skip_offset": 12}])
    assert nanolab_here(*fit, "--run.fresh", "true", cwd=tmp_path).returncode == 0
    assert nanolab_here(*fit, "--run.name", "clean", cwd=tmp_path).returncode == 0

    def losses(name: str) -> list[float]:
        return [
            r["loss"] for r in read_records(tmp_path / "runs" / name / "metrics.jsonl", "train")
        ]

    assert losses("tiny") == losses("clean")
    assert read_ledger(tmp_path / "runs" / "tiny") == []
    (archived,) = (tmp_path / "runs" / "tiny" / "previous").iterdir()
    assert read_ledger(archived)[0]["skip_offset"] == 12


def accumulating_config(tmp: Path, char_dataset: Path, micro_batch_size: int, steps: int, **extra):
    """The tiny model at 512 tokens a step: micro-batch 4 accumulates 4, micro-batch 16 none."""
    cfg = tiny_overrides(char_dataset, tmp / "runs", **extra)
    cfg["trainer"]["max_steps"] = steps
    cfg["data"]["micro_batch_size"] = micro_batch_size
    cfg["run"].update(name="acc", global_batch_tokens=512, eval_every_steps=4)
    cfg["checkpoint"] = {"every_n_steps": 2}
    cfg["spike"] = {"window": 5, "patience": 2, **cfg.get("spike", {})}
    return write_config(tmp / f"acc-{micro_batch_size}-{steps}.yaml", cfg)


def test_the_guard_watches_the_step_loss_the_run_log_records_when_accumulating(
    tmp_path: Path, char_dataset: Path
) -> None:
    """Lightning hands callbacks a micro-batch's loss divided by the accumulation; the guard
    compares the step's own loss (4 micro-batches a step here), as the train record says it."""
    cfg = accumulating_config(
        tmp_path, char_dataset, 4, 12,
        # the last micro-batch of step 8 steps at a rate that wrecks the weights
        trainer__callbacks=[{**poison(), "init_args": {"first": 31, "last": 31, "lr_factor": 3e4}}],
        model__schedule={"warmup_steps": 2},
        spike={"action": "warn", "window": 3, "patience": 1},
    )  # fmt: skip
    proc = nanolab_here("fit", "--config", str(cfg), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = list(read_records(tmp_path / "runs" / "acc" / "metrics.jsonl"))
    train = {r["step"]: r["loss"] for r in records if r["event"] == "train"}
    spikes = [r for r in records if r["event"] == "spike"]
    assert spikes, proc.stderr[-3000:]
    for spike in spikes:
        assert spike["loss"] == pytest.approx(train[spike["step"]], abs=1e-5), (spike, train)


@pytest.mark.slow
def test_a_resume_with_less_accumulation_keeps_the_same_losses_and_rolls_nothing_back(
    tmp_path: Path, char_dataset: Path
) -> None:
    """Saved at accumulation 4, resumed with the same global batch at accumulation 1: the
    saved history is the steps' losses, so the resumed ones are no spike (they were 4x it)."""
    cfg = accumulating_config(tmp_path, char_dataset, 4, 10)
    first = nanolab_here("fit", "--config", str(cfg), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    cfg = accumulating_config(tmp_path, char_dataset, 16, 20)
    proc = nanolab_here("fit", "--config", str(cfg), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = list(read_records(tmp_path / "runs" / "acc" / "metrics.jsonl"))
    assert [r for r in records if r["event"] == "spike"] == []
    assert not (tmp_path / "runs" / "acc" / "checkpoints" / "rolled_back").exists()


class _Module:
    automatic_optimization = True


def test_a_history_saved_divided_by_the_accumulation_is_rescaled_or_started_afresh() -> None:
    """Checkpoints from before the guard watched the step's loss hold loss / accumulation: a
    resume multiplies it back by the accumulation their layout records, or drops it if none."""
    saved = {"history": [1.0, 1.5, 1.25]}
    guard = SpikeGuard(window=3)
    guard.on_load_checkpoint(None, _Module(), {"nanolab": {"layout": {"accumulate": 4}}})
    guard.load_state_dict(saved)
    assert list(guard.history) == [4.0, 6.0, 5.0]
    unknown = SpikeGuard(window=3)
    unknown.on_load_checkpoint(None, _Module(), {"nanolab": {}})
    unknown.load_state_dict(saved)
    assert list(unknown.history) == []
    current = SpikeGuard(window=3)
    current.on_load_checkpoint(None, _Module(), {"nanolab": {"layout": {"accumulate": 4}}})
    current.load_state_dict(guard.state_dict())  # saved now: the step's losses, kept as they are
    assert list(current.history) == [4.0, 6.0, 5.0]


def test_a_save_takes_the_step_values_still_in_flight_and_the_next_step_does_not_count_them_again():
    """On a GPU a step's values arrive at the next step (:mod:`nanolab.callbacks.readout`); a
    save before that must still hold them. :func:`settle_step_values` hands them to the spike
    guard and the divergence stop at the save; the next step brings the same values again in
    its ``completed``, and they are not counted twice. Mutations caught: no settle (the window
    and the streak without step 4), the next step counting step 4 again (a streak of 2)."""
    from types import SimpleNamespace

    import torch

    from nanolab.callbacks.clock import RunClock
    from nanolab.callbacks.divergence import FLAG_KEYS, DivergenceStop
    from nanolab.callbacks.readout import StepReadout
    from nanolab.callbacks.spike import LOSS_KEY
    from nanolab.callbacks.step import settle_step_values

    clock = RunClock()
    clock.readout = readout = StepReadout(defer=True)
    guard, stop = SpikeGuard(window=3, patience=2, action="warn"), DivergenceStop(patience=3)
    trainer = SimpleNamespace(callbacks=[guard, stop, clock], lightning_module=None)
    for callback in (guard, stop):
        callback.active, callback.clock = True, clock

    def step(k: int, loss: float) -> None:
        readout.begin(k)
        readout.put(LOSS_KEY, torch.tensor(loss))
        readout.put(FLAG_KEYS[0], torch.tensor(float(not math.isfinite(loss))))
        readout.transfer()
        for callback in (stop, guard):
            callback.on_step(trainer, None, k)

    for k, loss in enumerate([1.0, 1.0, 1.0, float("nan")], start=1):
        step(k, loss)
    assert stop.bad.count == 0  # step 4's flag is still on its way
    settle_step_values(trainer)  # a save at step 4
    assert (stop.bad.count, stop.bad.first) == (1, 4)
    assert list(guard.history) == [1.0, 1.0, 1.0]
    step(5, 9.0)  # brings step 4 again (drained at the save): not counted twice
    assert (stop.bad.count, stop.bad.first) == (1, 4)
    settle_step_values(trainer)
    assert (stop.bad.count, guard.high.count, guard.high.first) == (0, 1, 5)


def test_a_run_resumed_from_a_checkpoint_saved_with_its_values_in_flight_detects_the_same_spikes(
    tmp_path: Path, char_dataset: Path
) -> None:
    """The step's values go to the host a step late on a GPU (here ``NANOLAB_READOUT_DEFER=1``
    on a CPU): the step-6 checkpoint held the guard's state without step 6, so the run that
    reported the spike from step 5 at step 6 reported it again at step 7 when resumed from that
    checkpoint. Now every save takes the values in flight first: the resumed run's spikes are
    the uninterrupted run's, and the saved state is the one the blocking path saves."""
    import shutil

    import torch

    from nanolab.callbacks.readout import DEFER_ENV

    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=16)
    cfg["run"].update(eval_every_steps=4, global_batch_tokens=256)
    cfg["trainer"]["precision"] = "bf16-mixed"
    cfg["model"].update(optimizer={"lr": 0.05}, schedule={"warmup_steps": 2})
    cfg["checkpoint"] = {"every_n_steps": 2, "keep_last": 10}
    cfg["spike"] = {"action": "warn", "window": 3, "patience": 2, "factor": 1.001,
                    "min_increase": 0}  # fmt: skip
    config = str(write_config(tmp_path / "spiky.yaml", cfg))
    saved = {}
    for defer in ("0", "1"):
        spikes = {}
        for name, resume in ((f"d{defer}", None), (f"d{defer}r", tmp_path / f"s{defer}.ckpt")):
            extra = ["--run.resume", str(resume)] if resume else []
            proc = nanolab_here(
                "fit", "--config", str(QUICKSTART), "--config", config, "--run.name", name,
                *extra, cwd=tmp_path, env={DEFER_ENV: defer},
            )  # fmt: skip
            assert proc.returncode == 0, proc.stderr[-3000:]
            run = tmp_path / "runs" / name
            spikes[name] = [
                (r["step"], r["began"]) for r in read_records(run / "metrics.jsonl", "spike")
            ]
            if resume is None:  # the step-6 checkpoint, kept out of the run's rotation
                shutil.copy(run / "checkpoints" / "step-00000006.ckpt", tmp_path / f"s{defer}.ckpt")
        assert spikes[f"d{defer}"], spikes  # the settings make this run spike
        assert spikes[f"d{defer}r"] == [s for s in spikes[f"d{defer}"] if s[0] > 6], spikes
        ckpt = torch.load(tmp_path / f"s{defer}.ckpt", weights_only=True, map_location="cpu")
        saved[defer] = {k: v for k, v in ckpt["callbacks"].items() if "Spike" in k or "Diverg" in k}
    assert saved["1"] == saved["0"]


@pytest.mark.parametrize("defer", ["0", "1"])
@pytest.mark.parametrize(("every", "verdict", "code"), [(1, "rollback", 75), (2, "diverged", 3)])
def test_a_signal_at_the_step_a_spike_is_judged_leaves_the_verdict_standing(
    tmp_path: Path, char_dataset: Path, defer: str, every: int, verdict: str, code: int
) -> None:
    """A SIGTERM in step 3, the step the guard finds a spike at: the preemption saved step 3
    after the guard had rolled back from it (last.ckpt then pointed at the spiked weights, which
    the rerun resumed from with the ledger's skip in force) or had stopped without saving it;
    on a CPU it saved nothing and said "parameters not finite". Both exited 75. Now the
    verdict stands, on the GPU path (``NANOLAB_READOUT_DEFER=1``) too, where the step's loss
    arrives only when the preemption settles the values: no step-3 checkpoint; a rollback
    ends as one and exits 75 (the signal asked to stop: the rerun continues from step 1); a
    stop ends as diverged, exit 3."""
    from nanolab.callbacks.readout import DEFER_ENV

    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=8)
    cfg["run"]["eval_every_steps"] = 100
    cfg["checkpoint"] = {"every_n_steps": every, "keep_last": 5}
    cfg["spike"] = {"factor": 1.000001, "min_increase": 0, "window": 2, "patience": 1}
    cfg["trainer"]["callbacks"] = [{"class_path": "cli_probes.SignalAt", "init_args": {"step": 2}}]
    config = str(write_config(tmp_path / "t.yaml", cfg))
    proc = nanolab_here("fit", "--config", config, cwd=tmp_path, env={DEFER_ENV: defer})
    assert proc.returncode == code, proc.stderr[-3000:]
    run = tmp_path / "runs" / "tiny"
    (spike,) = read_records(run / "metrics.jsonl", "spike")
    assert spike["step"] == 3
    end = read_records(run / "metrics.jsonl", "end")[-1]
    assert (end["reason"], end["step"]) == (verdict, 3)
    said = "rerun the same command to continue from there" if code == 75 else "fit: diverged:"
    assert said in proc.stderr and "not finite" not in proc.stderr, proc.stderr[-3000:]
    saved = sorted(p.name for p in (run / "checkpoints").rglob("step-*.ckpt"))
    assert "step-00000003.ckpt" not in saved, saved
    assert [r["step"] for r in read_records(run / "metrics.jsonl", "checkpoint")] == list(
        range(every, 3, every)
    )
