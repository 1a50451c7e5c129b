"""The JSONL run log: schema, append on resume, run-directory ownership, end reasons."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import lightning as L
import pytest
import torch
from test_callbacks_runlog import TOKENS_PER_MICRO_BATCH, events, fit

from nanolab.callbacks import (
    CostBudget,
    MetricsLog,
    RotatingCheckpoint,
    RunDirError,
    ThroughputMeter,
    set_stop_reason,
)
from nanolab.callbacks.readout import DEFER_ENV
from nanolab.callbacks.rundir import claim_run_dir
from nanolab.callbacks.step import StepCallback
from nanolab.runlog import read_records
from nanolab.training.optim import OptimizerConfig

COMMON = ("event", "time", "step")
SCHEMA = {
    "start": (
        "run_id", "run_name", "run_dir", "resumed_from_step", "config", "seed", "git_commit",
        "versions", "devices", "device_count", "world_size", "num_nodes", "precision",
        "strategy", "accelerator", "num_params", "global_batch_tokens", "flops_per_token",
        "peak_flops", "price_per_gpu_hour",
    ),
    "train": (
        "epoch", "tokens", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s",
        "samples_per_s", "mfu", "mem_allocated_bytes", "mem_reserved_bytes", "elapsed_s",
        "gpu_hours", "cost", "goodput",
    ),
    "val": ("tokens", "val_loss", "val_ppl"),
    "budget": ("rule", "decision"),
    "checkpoint": ("path", "seconds", "bytes", "async"),
    "end": (
        "reason", "error", "elapsed_s", "gpu_hours", "cost", "tokens", "goodput", "best_val_loss",
    ),
}  # fmt: skip


def all_callbacks(**checkpoint: object) -> list[L.Callback]:
    return [
        MetricsLog(),
        RotatingCheckpoint(**{"every_n_steps": 4, **checkpoint}),
        CostBudget(price_per_gpu_hour=2.5),
        ThroughputMeter(),
    ]


def test_records_follow_the_schema(tmp_path, char_dataset):
    run = tmp_path / "run"
    fit(run, char_dataset, all_callbacks(), max_steps=8, module_kwargs={"extra_logs": True})
    records = read_records(run / "metrics.jsonl")
    kinds = [r["event"] for r in records]
    assert kinds[0] == "start" and kinds[-1] == "end"
    assert kinds.count("train") == 8 and kinds.count("val") == 2 and kinds.count("budget") == 2
    assert kinds.count("checkpoint") == 2
    for record in records:
        for key in (*COMMON, *SCHEMA[record["event"]]):
            assert key in record, (record["event"], key)
        assert isinstance(record["time"], float)

    start = records[0]
    assert start["resumed_from_step"] is None and start["world_size"] == 1
    assert start["global_batch_tokens"] == TOKENS_PER_MICRO_BATCH
    assert start["flops_per_token"] > 0 and start["price_per_gpu_hour"] == 2.5
    assert start["devices"] and start["versions"]["torch"] == torch.__version__

    train = events(run / "metrics.jsonl", "train")
    assert [r["step"] for r in train] == list(range(1, 9))
    assert [r["tokens"] for r in train] == [s * TOKENS_PER_MICRO_BATCH for s in range(1, 9)]
    for r in train:
        assert r["loss"] > 0 and r["grad_norm"] > 0 and r["lr"] > 0
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and 0 <= r["goodput"] <= 1
        assert r["cost"] == pytest.approx(r["gpu_hours"] * 2.5)
        assert r["mfu"] is None  # CPU: no peak in the table, never a made-up number
        assert r["train/aux"] == pytest.approx(2 * r["loss"], rel=1e-5)  # self.log lands here
        assert "val/loss" not in r  # stale validation values are not repeated
    assert all(b["gpu_hours"] >= a["gpu_hours"] for a, b in itertools.pairwise(train))

    val = events(run / "metrics.jsonl", "val")
    assert [r["step"] for r in val] == [4, 8]
    assert val[0]["val_ppl"] == pytest.approx(2.718281828 ** val[0]["val_loss"], rel=1e-6)
    assert val[0]["val/acc"] == 0.25

    end = records[-1]
    assert end["reason"] == "completed" and end["error"] is None
    assert end["tokens"] == 8 * TOKENS_PER_MICRO_BATCH
    assert end["best_val_loss"] == min(v["val_loss"] for v in val)
    assert end["cost"] == pytest.approx(end["gpu_hours"] * 2.5)
    assert 0 < end["goodput"] <= 1


def test_resume_appends_after_a_half_written_line(tmp_path, char_dataset):
    run = tmp_path / "run"
    fit(run, char_dataset, all_callbacks(), max_steps=4)
    log = run / "metrics.jsonl"
    with open(log, "a") as f:
        f.write('{"event": "train", "step": 5, "lo')  # killed mid-write
    before = log.read_bytes()
    first_end = events(log, "end")[-1]

    fit(
        run, char_dataset, all_callbacks(), max_steps=8, ckpt_path=run / "checkpoints" / "last.ckpt"
    )

    assert log.read_bytes().startswith(before)
    starts = events(log, "start")
    assert len(starts) == 2 and starts[1]["resumed_from_step"] == 4
    assert starts[0]["run_id"] == starts[1]["run_id"]
    train = events(log, "train")
    assert [r["step"] for r in train] == list(range(1, 9))
    assert train[4]["tokens"] == 5 * TOKENS_PER_MICRO_BATCH  # counted across the resume
    assert train[4]["elapsed_s"] > first_end["elapsed_s"]  # wall time summed over processes
    assert train[4]["gpu_hours"] > first_end["gpu_hours"]
    unparsable = [line for line in log.read_text().splitlines() if line.endswith('"lo')]
    assert len(unparsable) == 1


def test_a_different_run_is_refused_and_fresh_archives_it(tmp_path, char_dataset):
    run = tmp_path / "run"
    fit(run, char_dataset, [MetricsLog(), RotatingCheckpoint(every_n_steps=2)], max_steps=2)
    log = run / "metrics.jsonl"
    before = log.read_bytes()
    with pytest.raises(RunDirError, match=r"already holds run .* run\.fresh: true"):
        fit(run, char_dataset, [MetricsLog(), RotatingCheckpoint(every_n_steps=2)], max_steps=2)
    assert log.read_bytes() == before  # nothing written

    fit(
        run,
        char_dataset,
        [MetricsLog(fresh=True), RotatingCheckpoint(every_n_steps=2)],
        max_steps=2,
    )
    archived = list((run / "previous").iterdir())
    assert len(archived) == 1
    assert (archived[0] / "metrics.jsonl").read_bytes() == before
    assert (archived[0] / "checkpoints" / "last.ckpt").is_file()
    old_id = read_records(archived[0] / "metrics.jsonl", "start")[0]["run_id"]
    assert archived[0].name.startswith(old_id)
    starts = events(log, "start")
    assert len(starts) == 1 and starts[0]["run_id"] != old_id


def test_fresh_takes_the_old_runs_rollback_ledger_with_it(tmp_path, char_dataset):
    # The rollback ledger shifts the data order and the LR of the run that wrote it; a fresh
    # run (or a new one where the old log and checkpoints were deleted by hand) must not
    # inherit it, and the old run keeps it beside its log and checkpoints.
    from nanolab.data.skips import read_ledger, write_ledger

    run = tmp_path / "run"
    fit(run, char_dataset, [MetricsLog(), RotatingCheckpoint(every_n_steps=2)], max_steps=2)
    write_ledger(run, [{"restored": 2, "skip_at": 2, "skip_offset": 12}])
    ledger = (run / "rollbacks.json").read_bytes()
    fit(run, char_dataset, [MetricsLog(fresh=True), RotatingCheckpoint(every_n_steps=2)],
        max_steps=2)  # fmt: skip
    (archived,) = (run / "previous").iterdir()
    assert (archived / "rollbacks.json").read_bytes() == ledger
    assert read_ledger(run) == []

    gone = tmp_path / "gone"  # a run whose log and checkpoints were deleted by hand
    gone.mkdir()
    write_ledger(gone, [{"restored": 2, "skip_at": 2, "skip_offset": 12}])
    claim = claim_run_dir(gone, {"model": {}}, resuming=False)
    assert claim.archived_to is not None and (claim.archived_to / "rollbacks.json").is_file()
    assert read_ledger(gone) == []


def test_run_directory_claims(tmp_path):
    config = {"model": {"lr": 1.0}, "run": {"resume": "auto"}}
    claim = claim_run_dir(tmp_path / "a", config, resuming=False)
    assert claim.run_id and (tmp_path / "a").is_dir()
    (tmp_path / "a" / "metrics.jsonl").write_text(
        '{"event":"start","run_id":"abc","config":{"model":{"lr":1.0},"run":{"resume":"never"}}}\n'
    )
    # Same config (resume policy aside), no checkpoint yet: the same run restarting.
    assert claim_run_dir(tmp_path / "a", config, resuming=False).run_id == "abc"
    with pytest.raises(RunDirError, match=r"config differs at: model\.lr"):
        claim_run_dir(tmp_path / "a", {"model": {"lr": 2.0}}, resuming=False)
    with pytest.raises(RunDirError, match="drop one of them"):
        claim_run_dir(tmp_path / "a", config, resuming=True, fresh=True)
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(RunDirError, match="not writable"):
        claim_run_dir(blocker / "run", config, resuming=False)


@pytest.mark.parametrize("how", ["exception", "preempted", "sigterm"])
def test_end_reasons(tmp_path, char_dataset, how):
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    class Stopper(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 3:
                if how == "preempted":
                    set_stop_reason(trainer, "preempted", "test signal")
                else:
                    raise SIGTERMException(75)

    run = tmp_path / "run"
    callbacks = [MetricsLog(), RotatingCheckpoint(every_n_steps=None)]
    if how == "exception":
        with pytest.raises(RuntimeError, match="scripted failure"):
            fit(run, char_dataset, callbacks, module_kwargs={"fail_at_step": 2})
        end = events(run / "metrics.jsonl", "end")[-1]
        assert end["reason"] == "error" and "scripted failure at step 2" in end["error"]
        assert not (run / "checkpoints").exists()  # nothing saved from a failed state
        return
    if how == "sigterm":
        with pytest.raises(SIGTERMException):
            fit(run, char_dataset, [*callbacks, Stopper()])
    else:
        fit(run, char_dataset, [*callbacks, Stopper()])
    end = events(run / "metrics.jsonl", "end")[-1]
    assert end["reason"] == "preempted" and end["error"] is None and end["step"] == 3
    if how == "preempted":  # a graceful stop saves the final state
        ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
        assert ckpt["global_step"] == 3


def test_a_run_log_deleted_while_written_is_recreated_and_said(tmp_path, capsys) -> None:
    """`rm metrics.jsonl` during a run: the next record starts the file again at its path,
    after a `log_recreated` record, with one warning; nothing goes into the unlinked file."""
    from nanolab.runlog import RunLogWriter, read_records

    path = tmp_path / "metrics.jsonl"
    writer = RunLogWriter(path)
    writer.write({"event": "train", "step": 1})
    path.unlink()
    writer.write({"event": "train", "step": 2})
    writer.write({"event": "train", "step": 3})
    writer.close()
    assert [r["event"] for r in read_records(path)] == ["log_recreated", "train", "train"]
    assert [r.get("step") for r in read_records(path)] == [2, 2, 3]
    assert capsys.readouterr().err.count("was deleted or replaced while this run wrote it") == 1


def test_a_full_disk_under_the_run_log_is_one_clear_error(tmp_path) -> None:
    """ENOSPC while appending (/dev/full stands in for a full disk): a NanolabError naming the
    file and the free space, not an OSError traceback."""
    import os

    from nanolab.runlog import RunLogWriteError, RunLogWriter

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    path = tmp_path / "metrics.jsonl"
    writer = RunLogWriter(path)
    writer.write({"event": "train", "step": 1})
    full = open("/dev/full", "ab", buffering=0)  # noqa: SIM115 - the writer closes it
    writer._handle, writer._inode = full, os.stat(path)[1:3]
    with pytest.raises(RunLogWriteError, match="No space left on device") as err:
        writer.write({"event": "train", "step": 2})
    assert str(path) in str(err.value) and "MB free there" in str(err.value)
    assert "rerun the same command to resume" in str(err.value)
    writer.close()  # closing says nothing more


def test_a_resume_that_moves_max_steps_inside_the_lr_plan_says_what_the_lr_does(
    tmp_path, char_dataset, capsys
):
    # The cosine was planned for 8 steps and the checkpoint keeps the plan: resumed at 4 with
    # max_steps 6, the run stops before it anneals, and says so once with the LR it stops at.
    run = tmp_path / "run"
    fit(run, char_dataset, [MetricsLog(), RotatingCheckpoint(every_n_steps=4)], max_steps=8)
    capsys.readouterr()
    fit(run, char_dataset, [MetricsLog(), RotatingCheckpoint(every_n_steps=4)],
        max_steps=6, ckpt_path=run / "checkpoints" / "step-00000004.ckpt")  # fmt: skip
    err = capsys.readouterr().err
    assert err.count("max_steps 6 is short of the 8 steps this run's LR schedule was planned") == 1
    assert "before the cosine reaches its minimum at step 8" in err
    # The figure is the LR step 6 trained at, 55% (it quoted step 7's, 32%).
    last = [r for r in events(run / "metrics.jsonl", "train") if r["step"] == 6][-1]
    assert f"stops at step 6 with the LR at {last['lr'] / OptimizerConfig().lr:.0%}" in err
    fit(run, char_dataset, [MetricsLog(), RotatingCheckpoint(every_n_steps=4)],
        max_steps=8, ckpt_path=run / "checkpoints" / "step-00000004.ckpt")  # fmt: skip
    assert "planned for" not in capsys.readouterr().err  # the plan's own end: nothing to say


def test_a_resume_past_the_lr_plan_a_token_budget_made_says_what_the_lr_does(
    tmp_path, char_dataset, capsys
):
    # trainer.max_steps -1: budget.max_tokens planned the cosine for 8 steps. Resumed at 4 with
    # the budget raised to 16 steps (or set to null), the steps past 8 train at the minimum LR:
    # it went without a word (a larger trainer.max_steps is said).
    run = tmp_path / "run"
    ckpt = RotatingCheckpoint(every_n_steps=4)
    budget = 8 * TOKENS_PER_MICRO_BATCH
    fit(run, char_dataset, [MetricsLog(), ckpt, CostBudget(max_tokens=budget)], max_steps=-1,
        max_epochs=-1)  # fmt: skip
    assert events(run / "metrics.jsonl", "train")[-1]["step"] == 8
    capsys.readouterr()
    resume = tmp_path / "step-4.ckpt"  # the rotation deletes it as the run goes on
    resume.write_bytes((run / "checkpoints" / "step-00000004.ckpt").read_bytes())
    fit(run, char_dataset, [MetricsLog(), RotatingCheckpoint(every_n_steps=4),
        CostBudget(max_tokens=2 * budget)], max_steps=-1, max_epochs=-1, ckpt_path=resume)  # fmt: skip
    err = capsys.readouterr().err
    said = (
        f"budget.max_tokens {2 * budget} (it stops the run at step 16) is past the 8 steps this "
        "run's LR schedule was planned for (a resume keeps the plan): the LR reaches its minimum "
        "at step 8 and the last 8 steps run there; to anneal over all 16 steps, train a new run "
        f"(run.fresh: true, or another run.name) with budget.max_tokens {2 * budget}"
    )
    assert err.count(said) == 1, err
    train = [r for r in events(run / "metrics.jsonl", "train") if r["step"] > 8]
    assert [r["lr"] for r in train] == pytest.approx([0.1 * OptimizerConfig().lr] * 8)  # as said
    fit(run, char_dataset, [MetricsLog(), RotatingCheckpoint(every_n_steps=4),
        CostBudget(max_wall_hours=1.0)], max_steps=-1, max_epochs=-1, ckpt_path=resume,
        max_time={"seconds": 3})  # fmt: skip
    err = capsys.readouterr().err
    assert err.count("no trainer.max_steps or budget.max_tokens bounds the run in steps") == 1
    assert "the LR reaches its minimum at step 8 and every step after runs there" in err


@pytest.mark.parametrize("max_steps", [4, 6, 7])
def test_a_new_run_whose_warmup_fills_it_says_the_lr_never_decays(
    tmp_path, char_dataset, capsys, max_steps
):
    # Warm-up 5: step k trains at (k) / 6 of the peak up to step 5 and at the peak at step 6,
    # so a run of 4 or 6 steps never decays (it ran with no word); 7 steps decay at the last.
    from nanolab.training.optim import ScheduleConfig

    run = tmp_path / "run"
    fit(run, char_dataset, [MetricsLog()], max_steps=max_steps,
        module_kwargs={"schedule": ScheduleConfig(warmup_steps=5)})  # fmt: skip
    err = capsys.readouterr().err
    said = "warmup_steps 5 does not end before trainer.max_steps"
    if max_steps == 7:
        assert said not in err
        return
    assert err.count(said) == 1
    last = events(run / "metrics.jsonl", "train")[-1]
    share = last["lr"] / OptimizerConfig().lr
    assert f"the LR rises to {share:.0%} of its peak at the last step and never decays" in err
    assert f"a run of {max_steps} steps is too short to decay: give it at least 10 steps" in err


def test_a_token_budget_that_ends_a_run_inside_its_warmup_says_the_lr_never_decays(
    tmp_path, char_dataset, capsys
):
    # trainer.max_steps -1 and budget.max_tokens 4 steps with a 5-step warm-up: the banner
    # said "the LR cosine ends at step 4" and no warning came, while the LR never left the
    # warm-up (trainer.max_steps 4 warns).
    from nanolab.callbacks.banner import banner_lines
    from nanolab.training.optim import ScheduleConfig

    run, budget = tmp_path / "run", 4 * TOKENS_PER_MICRO_BATCH
    trainer = fit(run, char_dataset, [MetricsLog(), CostBudget(max_tokens=budget)],
                  max_steps=-1, max_epochs=-1,
                  module_kwargs={"schedule": ScheduleConfig(warmup_steps=5)})  # fmt: skip
    err = capsys.readouterr().err
    said = (
        f"model.schedule.warmup_steps 5 does not end before budget.max_tokens {budget} (it "
        "stops the run at step 4): the LR rises to 67% of its peak at the last step"
    )
    assert err.count(said) == 1, err
    last = events(run / "metrics.jsonl", "train")[-1]
    assert last["step"] == 4 and last["lr"] / OptimizerConfig().lr == pytest.approx(4 / 6)
    banner = "\n".join(banner_lines(trainer, trainer.lightning_module, estimate=False))
    assert "budget.max_tokens stops it at step 4, inside the LR's 5-step warm-up" in banner
    assert "the LR cosine ends" not in banner


@pytest.mark.parametrize(
    ("max_steps", "warmup", "fix"),
    [
        (1, 0, None),  # at the peak from step 1: nothing to fix (it advised "(here 0)")
        (2, 1, "a run of 2 steps is too short to decay: give it at least 10 steps, with"),
        (4, 100, "a run of 4 steps is too short to decay: give it at least 10 steps, with"),
        (
            20,
            50,
            "set model.schedule.warmup_steps to at most a tenth of trainer.max_steps (here 2)",
        ),
    ],
)
def test_the_warmup_warning_advises_what_the_run_can_do(
    tmp_path, char_dataset, capsys, max_steps, warmup, fix
):
    # A run of 1 to 9 steps was told to set warmup_steps to at most "(here 0)", even with no
    # warm-up at all: the advice is the run's length then, and no warm-up is no warning.
    from nanolab.training.optim import ScheduleConfig

    fit(tmp_path / "run", char_dataset, [MetricsLog()], max_steps=max_steps,
        module_kwargs={"schedule": ScheduleConfig(warmup_steps=warmup)})  # fmt: skip
    err = capsys.readouterr().err
    said = f"model.schedule.warmup_steps {warmup} does not end before trainer.max_steps"
    if fix is None:
        assert "model.schedule" not in err
        return
    assert err.count(said) == 1
    assert f"never decays; for a warm-up then a cosine decay, {fix}" in err
    assert "(here 0)" not in err


def test_a_decay_that_ends_inside_the_warmup_trains_resumes_and_warns_once(
    tmp_path, char_dataset, capsys
):
    # decay_steps 5 under a 6-step warm-up was refused at every construction, so a run an
    # earlier release started with it could not resume. It trains (steps 1-6 warm up, step 7
    # drops to the minimum, never the peak), resumes, and its launch says so once.
    from nanolab.training.optim import ScheduleConfig

    run = tmp_path / "run"
    schedule = {"schedule": ScheduleConfig(warmup_steps=6, decay_steps=5)}
    fit(run, char_dataset, [MetricsLog(), RotatingCheckpoint(every_n_steps=4)], max_steps=8,
        module_kwargs=schedule)  # fmt: skip
    err = capsys.readouterr().err
    said = "model.schedule.decay_steps 5 is not above model.schedule.warmup_steps 6"
    assert err.count(said) == 1
    assert "the LR rises to 86% of its peak by step 6, then drops to its minimum (10%)" in err
    assert "set model.schedule.decay_steps above warmup_steps, or null" in err
    assert "does not end before" not in err  # one line, not the warm-up's too
    lrs = {
        r["step"]: r["lr"] / OptimizerConfig().lr for r in events(run / "metrics.jsonl", "train")
    }
    assert lrs[6] == pytest.approx(6 / 7) and lrs[7] == pytest.approx(0.1)
    fit(run, char_dataset, [MetricsLog(), RotatingCheckpoint(every_n_steps=4)], max_steps=8,
        module_kwargs=schedule, ckpt_path=run / "checkpoints" / "step-00000004.ckpt")  # fmt: skip
    assert said not in capsys.readouterr().err  # a resume: said at the launch that chose it
    assert events(run / "metrics.jsonl", "end")[-1]["step"] == 8


@pytest.mark.parametrize(("every", "validated"), [(4, [4, 6]), (3, [3, 6]), (100, [6])])
def test_the_last_step_is_always_validated(tmp_path, char_dataset, every, validated):
    # 6 steps with a validation every 4 ended unvalidated: no final val loss anywhere.
    run = tmp_path / "run"
    fit(run, char_dataset, [MetricsLog()], max_steps=6, eval_every=every)
    assert [r["step"] for r in events(run / "metrics.jsonl", "val")] == validated
    (end,) = events(run / "metrics.jsonl", "end")
    assert (end["reason"], end["step"], end.get("detail")) == ("completed", 6, None)


def test_a_run_that_reaches_max_steps_is_completed_whatever_its_budget_rules_say(
    tmp_path, char_dataset
):
    # The last step's validation would trip a plateau of patience 1 (no gain of 10): the run
    # ends there anyway, so it is "completed", not stopped by a rule.
    run = tmp_path / "run"
    fit(run, char_dataset, [MetricsLog(), CostBudget(patience=1, min_delta=10.0)], max_steps=5,
        eval_every=4)  # fmt: skip
    (end,) = events(run / "metrics.jsonl", "end")
    assert (end["reason"], end["step"]) == ("completed", 5)
    run = tmp_path / "short"  # one step before the end, the same rule does stop it
    fit(run, char_dataset, [MetricsLog(), CostBudget(patience=1, min_delta=10.0)], max_steps=9,
        eval_every=4)  # fmt: skip
    (end,) = events(run / "metrics.jsonl", "end")
    assert (end["reason"], end["step"]) == ("plateau", 8)


@pytest.mark.parametrize(
    ("filename", "message"),
    [
        ("logs/metrics.jsonl", "a file name without folders"),
        # the run's own files: a log there took the ledger's (or queue log's) place, and every
        # later resume failed on "rollbacks.json cannot be read"
        ("rollbacks.json", "'rollbacks.json' is a file the run directory keeps for itself"),
        ("queue.log", "keeps for itself"),
        ("config.yaml", "keeps for itself"),
        ("checkpoints", "keeps for itself"),
        (".nanolab.lock", "keeps for itself"),
    ],
)
def test_log_filename_is_a_name_of_its_own(filename: str, message: str) -> None:
    from nanolab.callbacks.events import CallbackConfigError

    with pytest.raises(CallbackConfigError, match=message):
        MetricsLog(filename=filename)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_the_logged_rate_is_the_one_the_step_trained_with(tmp_path, char_dataset, name):
    """Step s trains at ``lr x schedule(s - 1)`` (the scheduler steps after the optimizer), with
    accumulation too, and its record says so; with Muon, the rate of the AdamW groups (those
    ``model.optimizer.lr`` sets), not Muon's ``muon_lr``. Mutation caught: the rate read when the
    record is built, after the scheduler stepped (every record showed the next step's rate, the
    last one a floor no step trained at)."""
    from nanolab.training.optim import OptimizerConfig, ScheduleConfig, lr_schedule

    used: dict[int, list[float]] = {}

    class RatesUsed(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            used[trainer.global_step + 1] = [g["lr"] for g in optimizer.param_groups]

    run = tmp_path / "run"
    optimizer = OptimizerConfig(name=name, lr=1e-3, muon_lr=0.02)
    fit(run, char_dataset, [MetricsLog(), RatesUsed()], max_steps=8, accumulate=2,
        module_kwargs={"optimizer": optimizer})  # fmt: skip
    planned = lr_schedule(ScheduleConfig(warmup_steps=2), 8)
    train = events(run / "metrics.jsonl", "train")
    assert [r["step"] for r in train] == list(range(1, 9))
    for r in train:
        assert r["lr"] == pytest.approx(1e-3 * planned(r["step"] - 1), rel=1e-9), r["step"]
        assert r["lr"] in used[r["step"]]
    assert train[-1]["lr"] > 1e-3 * planned(8)  # the floor comes after the last step


def test_epoch_counts_passes_over_the_data_and_the_banner_says_it_repeats(tmp_path):
    """A run longer than its training split: each train record's ``epoch`` is the windows the
    order served over the windows one epoch of it serves (it was Lightning's epoch counter,
    always 0 on nanolab's endless stream), and the banner says the data repeats and how
    often, over the tokens those windows hold."""
    from test_callbacks_runlog import BLOCK, MICRO

    from nanolab.callbacks.banner import banner_lines
    from nanolab.data.prepare import prepare_dataset

    text = tmp_path / "small.txt"
    text.write_text("".join(f"line {i} of a small corpus.\n" for i in range(15)))
    data = tmp_path / "small"
    prepare_dataset([str(text)], data, "chars", quiet=True)
    split = json.loads((data / "meta.json").read_text())["train_tokens"]
    windows = ((split - 1) // BLOCK - 1) // MICRO * MICRO  # one block of slack, whole batches
    run = tmp_path / "run"
    trainer = fit(run, data, [MetricsLog()], max_steps=12)
    train = events(run / "metrics.jsonl", "train")
    assert train[-1]["tokens"] > split
    for r in train:
        assert r["epoch"] == pytest.approx(r["step"] * MICRO / windows, abs=1e-4)
    banner = "\n".join(banner_lines(trainer, trainer.lightning_module, estimate=False))
    passes = 12 * MICRO / windows
    assert f"the data repeats: {passes:.3g} passes over its {windows * BLOCK} training" in (
        banner
    ), banner


def test_a_document_aligned_epoch_counts_the_rows_the_order_serves_not_the_cropped_split(
    tmp_path, char_dataset
):
    """With ``data.align: document`` packing crops most of a corpus of short documents: the
    third pass over its rows logged epoch 0.44 (tokens over the split's tokens, cropped ones
    included) and the banner never said the data repeats. An epoch is now the order's: the
    rows' micro-batches per epoch (``rows // micro_batch_size``), so step ``s`` is at
    ``s / (rows // 4)`` passes, and the banner says the run repeats its data."""
    from conftest import QUICKSTART, nanolab_here, tiny_overrides, write_config

    from nanolab.data.datamodule import TokenDataModule
    from nanolab.data.prepare import prepare_dataset

    words = ["which", "have", "not", "her", "but", "are", "were", "from", "the", "a"]
    lines = [
        json.dumps({"text": " ".join(words[(i * j) % 10] for j in range(5 + 7 * (i % 9)))})
        for i in range(120)
    ]
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("\n".join(lines) + "\n")
    data = tmp_path / "docs"
    prepare_dataset([str(corpus)], data, "chars", quiet=True)
    dm = TokenDataModule(dataset_dir=str(data), source=None, block_size=32, align="document")
    rows = len(dm.windows("train")[0])
    per_epoch = rows // 4
    steps = 3 * per_epoch - 2  # on the third pass
    cfg = tiny_overrides(data, tmp_path / "runs", data__align="document")
    cfg["trainer"]["max_steps"] = steps
    write_config(tmp_path / "d.yaml", cfg)
    done = nanolab_here("fit", "--config", str(QUICKSTART), "--config", str(tmp_path / "d.yaml"),
                        "--run.eval_every_steps", str(steps), cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    train = read_records(tmp_path / "runs" / "tiny" / "metrics.jsonl", "train")
    assert [r["epoch"] for r in train] == [
        pytest.approx(r["step"] / per_epoch, abs=1e-4) for r in train
    ]
    passes = steps / per_epoch
    kept = rows // 4 * 4 * 32 / 1000  # the tokens of the rows a pass serves, in thousands
    said = f"the data repeats: {passes:.3g} passes over its {kept:.3g}k training tokens"
    assert said in done.stdout + done.stderr


def test_a_forks_own_training_loader_logs_epoch_as_tokens_over_a_pass(tmp_path):
    """A fork's data module with a training loader of its own has no nanolab order to ask
    where it stands: every train record said ``epoch: null``. It is now the run's tokens over
    the tokens one pass holds as the data module says (``pass_tokens``; ``split_tokens`` where
    a module says only that)."""
    from test_callbacks_runlog import BLOCK, MICRO, make_module

    from nanolab.data.datamodule import TokenDataModule
    from nanolab.data.prepare import prepare_dataset

    text = tmp_path / "small.txt"
    text.write_text("".join(f"line {i} of a small corpus.\n" for i in range(15)))
    data = tmp_path / "small"
    prepare_dataset([str(text)], data, "chars", quiet=True)

    class OwnLoader(TokenDataModule):
        """A fork's module: nanolab's splits, its own training loader."""

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            x = torch.randint(0, self.vocab_size, (64, self.block_size + 1))
            pairs = list(zip(x[:, :-1], x[:, 1:], strict=True))
            return torch.utils.data.DataLoader(pairs, batch_size=self.micro_batch_size)

    module, _ = make_module(data)
    dm = OwnLoader(dataset_dir=str(data), source=None, micro_batch_size=MICRO,
                   block_size=BLOCK, val_windows=8)  # fmt: skip
    trainer = L.Trainer(
        default_root_dir=str(tmp_path / "run"), accelerator="cpu", devices=1, max_steps=6,
        enable_model_summary=False, num_sanity_val_steps=0, val_check_interval=3,
        check_val_every_n_epoch=None, callbacks=[MetricsLog()], enable_progress_bar=False,
        logger=False,
    )  # fmt: skip
    trainer.fit(module, dm)
    train = events(tmp_path / "run" / "metrics.jsonl", "train")
    per_pass = dm.pass_tokens
    assert per_pass < 6 * MICRO * BLOCK  # the run trains on more than one pass
    assert [r["step"] for r in train] == list(range(1, 7))
    assert [r["epoch"] for r in train] == [
        pytest.approx(r["step"] * MICRO * BLOCK / per_pass, abs=1e-4) for r in train
    ]
    assert [r["tokens"] for r in train] == [r["step"] * MICRO * BLOCK for r in train]

    from nanolab.data.order import declared_pass_tokens

    class SaysItsSplit:
        split_tokens = 4_000

    class CannotRead:
        @property
        def pass_tokens(self) -> int:
            raise OSError("meta.json is gone")

    assert declared_pass_tokens(SaysItsSplit()) == 4_000
    assert declared_pass_tokens(CannotRead()) is None
    assert declared_pass_tokens(None) is None


def test_a_new_run_from_another_runs_checkpoint_counts_its_own_tokens():
    """The model's tokens travel with a fork (a fine-tune keeps pretraining's count); the
    tokens its budget counts are only what this run trained on: the clock keeps the tokens it
    inherited, across the fork's own resumes. (Its ``epoch`` follows the data order's place.)"""
    from nanolab.callbacks.clock import RunClock

    fork = RunClock()
    fork.forked = True
    fork.load_state_dict({"tokens": 1_000_000, "samples": 10})
    fork.tokens += 5_000
    assert fork.run_tokens == 5_000
    resumed = RunClock()  # the fork resumed from its own checkpoint
    resumed.load_state_dict(fork.state_dict())
    assert resumed.run_tokens == 5_000
    own = RunClock()  # a run of its own from scratch
    own.load_state_dict({"tokens": 7_000, "samples": 10})
    assert own.run_tokens == 7_000
    own.start_new_run()  # the same run id taken over by a fork's first launch
    assert own.run_tokens == 0


class LogsForItsStep(StepCallback):
    """A fork's step callback logging every 3 steps, as docs/callbacks.md says (``step_values``),
    and a value in ``on_step`` (after its step's record took its values)."""

    def step_values(self, trainer, pl_module, step, readout) -> None:
        if step % 3 == 0:
            pl_module.log("train/from_callback", float(step))

    def on_step(self, trainer, pl_module, step) -> None:
        if step % 3 == 0:
            pl_module.log("train/too_late", float(step))


@pytest.mark.parametrize("defer", ["0", "1"])  # 1: the GPU's path, values a step later
def test_a_record_holds_what_was_logged_for_its_step_only(
    tmp_path, char_dataset, monkeypatch, capsys, defer
):
    """A value logged every 3 steps, by the module (in one of two micro-batches) or by a step
    callback's ``step_values``, is in the records of those steps, the last one included, and in
    no other: Lightning keeps the last value until the epoch ends, which the log once copied
    into every record between (as if measured there), and a callback's value landed a step late
    (the log read before the callbacks' hooks). One logged in ``on_step`` is in no record, and
    the run says where to log it instead."""
    monkeypatch.setenv(DEFER_ENV, defer)
    run = tmp_path / "run"
    callbacks = [MetricsLog(), LogsForItsStep()]
    fit(run, char_dataset, callbacks, max_steps=9, accumulate=2, module_kwargs={"log_every": 3})
    train = events(run / "metrics.jsonl", "train")
    assert [r["step"] for r in train] == list(range(1, 10))
    for r in train:
        logged = float(r["step"]) if r["step"] % 3 == 0 else None
        assert r.get("train/every") == logged, r
        assert r.get("train/from_callback") == logged, r
        assert "train/too_late" not in r and r["loss"] > 0
    (late,) = [line for line in capsys.readouterr().err.splitlines() if "too_late" in line]
    assert "logged at step 3 after the run log took" in late and "step_values" in late


class LogsWeightNorm(StepCallback):
    """A fork's step callback logging a value at steps 1, 11, 21, ... (none a record's step)."""

    def step_values(self, trainer, pl_module, step, readout) -> None:
        if step % 10 == 1:
            pl_module.log("train/weight_norm", float(step))


@pytest.mark.parametrize("defer", ["0", "1"])  # 1: the GPU's path, values a step later
def test_a_value_logged_between_records_is_in_the_next_record(
    tmp_path, char_dataset, monkeypatch, defer
):
    """With ``every_n_steps`` 5, values logged every 10 steps (by the module at the records'
    steps, by a step callback between them) and every 3 (a step callback) are each in the next
    record after they were logged, the newest value, once: nothing lost, nothing stale repeated.
    Mutation caught: what was logged at a step without a record was consumed there, so a value
    logged only between records reached no record at all."""
    monkeypatch.setenv(DEFER_ENV, defer)
    run = tmp_path / "run"
    callbacks = [MetricsLog(every_n_steps=5), LogsForItsStep(), LogsWeightNorm()]
    fit(run, char_dataset, callbacks, max_steps=30, eval_every=100,
        module_kwargs={"log_every": 10})  # fmt: skip
    train = events(run / "metrics.jsonl", "train")
    assert [r["step"] for r in train] == [5, 10, 15, 20, 25, 30]
    assert [r.get("train/every") for r in train] == [None, 10.0, None, 20.0, None, 30.0]
    assert [r.get("train/weight_norm") for r in train] == [1.0, None, 11.0, None, 21.0, None]
    assert [r.get("train/from_callback") for r in train] == [3.0, 9.0, 15.0, 18.0, 24.0, 30.0]
    assert all("train/too_late" not in r and r["loss"] > 0 for r in train)


class LogsAtMicroBatchEnd(L.Callback):
    """Logs in Lightning's ``on_train_batch_end``, after every micro-batch (as a module's hook)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pl_module.log("train/late", float(batch_idx))


def test_a_value_logged_after_the_read_is_said_to_be_recorded_later_or_not_at_all(
    tmp_path, char_dataset, capsys
):
    """Under gradient accumulation a value logged in ``on_train_batch_end`` after the step's read
    is in no record, but the one logged at the next step's first micro-batch is in that step's:
    the warning says a value logged there is recorded with a later step or not at all (it said no
    record held it, next to records that did)."""
    run = tmp_path / "run"
    fit(run, char_dataset, [MetricsLog(), LogsAtMicroBatchEnd()], max_steps=3, accumulate=2)
    train = events(run / "metrics.jsonl", "train")
    assert [r.get("train/late") for r in train] == [0.0, 2.0, 4.0]  # each step's first micro-batch
    (late,) = [line for line in capsys.readouterr().err.splitlines() if "train/late" in line]
    assert "logged at step 1 after the run log took step 1's values" in late, late
    assert "recorded with a later step or not at all" in late and "step_values" in late


class SignalledAt(L.Callback):
    """A SIGTERM arriving at ``step``, an evaluation step: the handler evaluates, then stops."""

    def __init__(self, handler: L.Callback, step: int) -> None:
        self.handler, self.step = handler, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import signal

        if trainer.global_step == self.step and self.handler.received is None:
            self.handler._handle(signal.SIGTERM, None)  # what the signal itself calls


class LogsLateAt(L.Callback):
    """Logs in ``on_train_batch_end`` at ``step`` only: after that step's record took its values."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            pl_module.log("train/late", 1.0)


@pytest.mark.parametrize("late", [False, True], ids=["nanolab-only", "a-late-log"])
def test_a_stop_after_an_evaluation_says_nothing_of_late_values_but_a_users(
    tmp_path, char_dataset, capsys, late
):
    """A signal at an evaluation step stops right after its validation: the validation's
    val/loss, val/bpb were taken for train values logged after the step's record (the results
    Lightning shows then are the validation's), and a plain run was told to fix code it never
    wrote. A value a callback does log late at that step is still named."""
    from nanolab.callbacks.preemption import Preempted, PreemptionHandler

    handler = PreemptionHandler()
    callbacks = [SignalledAt(handler, 4), MetricsLog(), RotatingCheckpoint(every_n_steps=None)]
    callbacks += [handler, *([LogsLateAt(4)] if late else [])]
    with pytest.raises(Preempted):
        fit(tmp_path / "run", char_dataset, callbacks, max_steps=8, eval_every=4)
    assert [r["step"] for r in events(tmp_path / "run" / "metrics.jsonl", "val")] == [4]
    warned = [line for line in capsys.readouterr().err.splitlines() if "was logged at" in line]
    if not late:
        assert warned == []
    else:
        (line,) = warned
        assert line.split(": warning: ")[1].startswith("train/late was logged at step"), line


class CopiesTheLogAt(L.Callback):
    """When step ``step + 1`` begins: copies the run log, what a process killed there leaves."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.left: list[dict] | None = None

    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        if self.left is None and trainer.global_step == self.step:
            with open(trainer.default_root_dir + "/metrics.jsonl") as log:
                self.left = [json.loads(line) for line in log]


@pytest.mark.parametrize("defer", ["0", "1"])
def test_a_process_killed_during_an_async_save_leaves_the_saved_steps_train_record(
    tmp_path, char_dataset, monkeypatch, defer
):
    """On a GPU a step's train record waits for its values until the next step; the save of
    that step took them first (for the spike guard), but the run log left its record pending,
    so a process killed while the async save ran (SIGKILL, the out-of-memory killer) lost the
    saved step's train record for good: the resumed log went train 1-3, start 4. Now the record
    is written before the save, as on a CPU."""
    monkeypatch.setenv(DEFER_ENV, defer)
    run = tmp_path / "run"
    copy = CopiesTheLogAt(4)
    callbacks = [MetricsLog(), RotatingCheckpoint(every_n_steps=4, async_save=True), copy]
    fit(run, char_dataset, callbacks, max_steps=6, eval_every=100)
    assert copy.left is not None
    train = [r for r in copy.left if r["event"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert train[-1]["loss"] > 0 and train[-1]["grad_norm"] > 0


@pytest.mark.slow  # a real process killed: ~35 s on 2 cores
def test_an_async_save_whose_process_was_killed_before_logging_it_is_recorded_on_resume(
    tmp_path, char_dataset
):
    """An async save's ``checkpoint`` record is written by the training thread at the step
    after the save is complete; a process SIGKILLed in between left a complete checkpoint, the
    one the resume continues from, that its log never mentioned. The resume now writes the
    record, marked ``recovered``, before its ``start`` record (the save was the earlier
    process's); the same resume again adds nothing."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from conftest import QUICKSTART, nanolab_here, tiny_overrides, write_config

    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=8)
    cfg["checkpoint"] = {"every_n_steps": 3, "async_save": True}
    cfg["run"]["eval_every_steps"] = 100
    write_config(tmp_path / "t.yaml", cfg)
    slow = ["--trainer.callbacks+=cli_probes.SlowSteps", "--trainer.callbacks.seconds", "2"]
    run = tmp_path / "runs" / "tiny"
    saved, last = run / "checkpoints" / "step-00000003.ckpt", run / "checkpoints" / "last.ckpt"
    tests = str(Path(__file__).resolve().parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [tests, os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    args = ["fit", "--config", str(QUICKSTART), "--config", "t.yaml"]
    proc = subprocess.Popen([sys.executable, "-m", "nanolab", *args, *slow], cwd=tmp_path,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        # Complete, and last.ckpt pointed at it: the writer thread is done with the save.
        while not (saved.exists() and last.exists() and os.path.samefile(saved, last)):
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)  # inside the next step's 2 s: its record is not out
    finally:
        proc.kill()
        proc.wait()
    log = run / "metrics.jsonl"
    assert [r["step"] for r in read_records(log, "checkpoint")] == []
    file = saved.stat()  # rotation deletes it later in the resume
    res = nanolab_here(*args, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    records = [r for r in read_records(log) if r["event"] in ("checkpoint", "start")]
    assert [(r["event"], r["step"]) for r in records] == [
        ("start", 0),
        ("checkpoint", 3),
        ("start", 3),
        ("checkpoint", 6),
        ("checkpoint", 8),
    ]
    recovered = records[1]
    assert recovered["recovered"] is True and recovered["path"] == str(saved)
    assert recovered["bytes"] == file.st_size and recovered["time"] == file.st_mtime
    assert [r.get("recovered") for r in records[3:]] == [None, None]
    before = read_records(log, "checkpoint")
    res = nanolab_here(*args, "--trainer.max_steps", "9", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert read_records(log, "checkpoint")[: len(before)] == before
    assert [r["step"] for r in read_records(log, "checkpoint")] == [3, 6, 8, 9]


def _checkpoint_files(folder, steps, mtime):
    """Step checkpoints of ``steps`` in ``folder``, each of 6 bytes, modified at ``mtime``."""
    import os

    folder.mkdir(parents=True, exist_ok=True)
    for step in steps:
        path = folder / f"step-{step:08d}.ckpt"
        path.write_bytes(b"weight")
        os.utime(path, (mtime, mtime))


def _checkpoint_records(log, folder, steps_and_times):
    with open(log, "a") as f:
        for step, when in steps_and_times:
            path = folder / f"step-{step:08d}.ckpt"
            record = {"event": "checkpoint", "time": when, "step": step, "path": str(path),
                      "bytes": 6}  # fmt: skip
            f.write(json.dumps(record) + "\n")


def test_a_resume_after_copying_the_run_records_no_checkpoint_twice(tmp_path) -> None:
    """A run folder copied with ``cp -r`` (or ``rsync -r``, a cloud sync, a network file
    system's clock ahead) gives every checkpoint a new file time: a resume matched a file to its
    record by step and "record time >= file time - 60 s" and wrote a false ``recovered`` record
    for each one its log already had. Only a save after the newest recorded one can lack its
    record (the kill window of an async save), matched by step and file name."""
    from nanolab.callbacks.checkpoint import unrecorded_checkpoints

    folder, log = tmp_path / "checkpoints", tmp_path / "metrics.jsonl"
    saved_at = 1_700_000_000.0
    _checkpoint_files(folder, [3, 6], saved_at + 3600)  # copied an hour later
    _checkpoint_records(log, Path("/elsewhere/checkpoints"), [(3, saved_at), (6, saved_at)])
    assert unrecorded_checkpoints(folder, log, upto=9) == []
    # the save the killed process never recorded is still found, whatever its time
    _checkpoint_files(folder, [9], saved_at - 7200)
    assert [r["step"] for r in unrecorded_checkpoints(folder, log, upto=9)] == [9]
    assert unrecorded_checkpoints(folder, log, upto=8) == []  # a resume from step 6


def test_a_checkpoint_saved_again_after_a_resume_from_an_earlier_one_is_recovered(
    tmp_path,
) -> None:
    """Resumed from step 3 of a run that had saved 3, 6 and 9: the record of step 9 from
    before names the file saved then, not the one saved again in the kill window."""
    from nanolab.callbacks.checkpoint import unrecorded_checkpoints

    folder, log = tmp_path / "checkpoints", tmp_path / "metrics.jsonl"
    first = 1_700_000_000.0
    _checkpoint_records(log, folder, [(3, first), (6, first), (9, first), (6, first + 500)])
    _checkpoint_files(folder, [3, 6], first)
    _checkpoint_files(folder, [9], first)  # the first launch's file: recorded
    assert unrecorded_checkpoints(folder, log, upto=9) == []
    _checkpoint_files(folder, [9], first + 900)  # saved again, its record never written
    assert [r["step"] for r in unrecorded_checkpoints(folder, log, upto=9)] == [9]


def test_the_hard_link_refusal_advises_a_fix_that_keeps_the_log_history(tmp_path) -> None:
    """A run log hard-linked elsewhere (a backup made with ``ln``/``cp -l``) is refused; its
    advice was to remove the log, which threw the run's history out of its run directory. The
    advice now is a copy of its own, and following it the run appends after its history."""
    import os
    import re
    import subprocess

    from nanolab.claimed import LeftClaimedDir
    from nanolab.runlog import RunLogWriter

    run = tmp_path / "run dir"  # a space: the advised command is quoted for the shell
    run.mkdir()
    path = run / "metrics.jsonl"
    writer = RunLogWriter(path)
    writer.write({"event": "start", "step": 0, "run_id": "r"})
    writer.write({"event": "train", "step": 1})
    writer.close()
    backup = tmp_path / "backup.jsonl"
    os.link(path, backup)
    history = backup.read_bytes()
    with pytest.raises(LeftClaimedDir, match="is a hard link") as err:
        RunLogWriter(path)
    said = str(err.value)
    assert "Remove" not in said
    (command,) = re.findall(r"\((cp .+ && mv .+)\) and rerun the same command to resume", said)
    subprocess.run(["bash", "-c", command], check=True)
    writer = RunLogWriter(path)
    writer.write({"event": "train", "step": 2})
    writer.close()
    assert [r.get("step") for r in read_records(path)] == [0, 1, 2]
    assert backup.read_bytes() == history and sorted(p.name for p in run.iterdir()) == [
        "metrics.jsonl"
    ]


def test_a_train_record_holds_the_same_keys_with_or_without_the_throughput_meter(
    tmp_path, char_dataset
):
    """The run log's placeholders for the meter's fields and the meter's own list were two
    lists: ``gpu_util`` was only in the meter's, so a run without the meter lacked the key
    that docs/callbacks.md lists. One list now (``METER_FIELDS``): a field the meter adds
    is a key of every train record, and ``log_to_loggers`` governs it."""
    from nanolab.callbacks.throughput import LOGGED_FIELDS

    keys = {}
    for name, callbacks in (
        ("with", [MetricsLog(), ThroughputMeter()]),
        ("without", [MetricsLog()]),
    ):
        fit(tmp_path / name, char_dataset, callbacks, max_steps=2, eval_every=2)
        keys[name] = [sorted(r) for r in events(tmp_path / name / "metrics.jsonl", "train")]
    assert keys["with"] == keys["without"] and len(keys["with"]) == 2
    assert set(keys["with"][0]) >= LOGGED_FIELDS and "gpu_util" in LOGGED_FIELDS


def test_the_banner_ends_the_run_where_its_token_budget_stops_it(
    tmp_path, char_dataset, capsys
) -> None:
    """``trainer.max_steps`` 50 with ``budget.max_tokens`` of 10 steps: the banner said
    ``steps 0 -> 50`` and the tokens of 50 steps to go, while the budget stops it at step 10."""
    run, budget = tmp_path / "run", 10 * TOKENS_PER_MICRO_BATCH
    from nanolab.callbacks.banner import banner_lines

    trainer = fit(run, char_dataset, [MetricsLog(), CostBudget(max_tokens=budget)], max_steps=50)
    assert events(run / "metrics.jsonl", "train")[-1]["step"] == 10
    banner = "\n".join(banner_lines(trainer, trainer.lightning_module, estimate=False))
    assert "steps      10 -> 10 (budget.max_tokens)" in banner, banner
    assert "-> 50" not in banner


def test_the_banner_ends_the_run_where_its_time_budget_stops_it(
    tmp_path, char_dataset, monkeypatch
) -> None:
    """The banner shortened its end only for ``budget.max_tokens``: a run that
    ``budget.max_wall_hours`` stops long before ``trainer.max_steps`` (or with no
    ``max_steps`` at all) was shown ending at ``max_steps``. It now states the step the
    budget's rule gives from what the run has spent, as an estimate at the step time the run
    measured (kept in its checkpoint), or at the plan's estimated step time before one."""
    import re

    from nanolab.callbacks import banner

    budget = CostBudget(max_wall_hours=1.0)
    trainer = fit(tmp_path / "run", char_dataset, [MetricsLog(), budget], max_steps=4)
    step_s = budget.measured_step_seconds()
    assert step_s is not None and step_s > 0
    trainer.fit_loop.epoch_loop.max_steps = (
        100_000  # a resume with a far end: the hours end it first
    )
    budget.max_wall_hours = budget.spent()["wall_hours"] + 100.5 * step_s / 3600
    text = "\n".join(banner.banner_lines(trainer, trainer.lightning_module, estimate=False))
    said = re.search(r"steps      4 -> ~(\d+) \(budget.max_wall_hours, an estimate at the "
                     r"measured [\d.e-]+ s/step\)", text)  # fmt: skip
    assert said is not None and 90 <= int(said.group(1)) <= 104, text
    assert "-> 100000" not in text

    budget.last_per_step = {}  # no step measured yet: the plan's step time
    trainer.fit_loop.epoch_loop.max_steps = -1
    budget.max_wall_hours = budget.spent()["wall_hours"] + 10.5 * 0.5 / 3600
    monkeypatch.setattr(banner, "_safe_estimate", lambda t, steps, tokens: (steps * 0.5, "plan"))
    text = "\n".join(banner.banner_lines(trainer, trainer.lightning_module))
    assert "(budget.max_wall_hours, planned at the estimated 0.5 s/step)" in text, text
    assert "no max_steps: a budget or a signal stops it" not in text
