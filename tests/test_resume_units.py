"""Choosing the checkpoint to resume from, and the preemption handler's signal plumbing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import nanolab_here, run_nanolab, tiny_overrides, write_config

from nanolab.callbacks.events import set_stop_reason
from nanolab.callbacks.preemption import PreemptionConfigError, PreemptionHandler, parse_signals
from nanolab.runlog import read_records
from nanolab.training.resume import (
    ResumeError,
    find_resume_checkpoint,
    inspect_checkpoint,
    resolve_resume,
    resume_candidate,
)

GPT = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 70, "dropout": 0.1}


def fake_checkpoint(path: Path, step: int, gpt: dict | None = None, **drop: bool) -> Path:
    """A file with the structure of a Lightning training checkpoint (small tensors)."""
    ckpt = {
        "state_dict": {"w": torch.full((4,), float(step))},
        "optimizer_states": [{"state": {}, "param_groups": []}],
        "lr_schedulers": [{"last_epoch": step}],
        "loops": {"fit_loop": {}},
        "global_step": step,
        "nanolab": {"gpt": gpt or GPT},
    }
    for key in drop:
        ckpt.pop(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(ckpt, path)
    return path


def test_newest_complete_checkpoint_wins_torn_ones_are_reported(tmp_path: Path) -> None:
    ckpts = tmp_path / "run" / "checkpoints"
    fake_checkpoint(ckpts / "step-00000010.ckpt", 10)
    good = fake_checkpoint(ckpts / "step-00000020.ckpt", 20)
    os.link(good, ckpts / "last.ckpt")  # last.ckpt is a hard link: opened once, by its step name
    torn = fake_checkpoint(ckpts / "step-00000030.ckpt", 30)
    torn.write_bytes(torn.read_bytes()[:100])
    fake_checkpoint(ckpts / "step-00000040.ckpt.tmp", 40)  # an atomic writer's unfinished file
    choice = find_resume_checkpoint(tmp_path / "run")
    assert choice.chosen is not None and choice.chosen.path == good and choice.chosen.step == 20
    assert [c.path.name for c in choice.skipped] == ["step-00000030.ckpt"]
    line = choice.warning()
    assert line is not None and "\n" not in line
    assert "step-00000030.ckpt (truncated or not a checkpoint)" in line
    assert line.endswith("resuming from step-00000020.ckpt (step 20)")


def test_a_checkpoint_with_an_overwritten_record_header_is_skipped(tmp_path: Path) -> None:
    """A newest checkpoint whose zip record header was overwritten (a bad sector) passed the
    memory-mapped check, so ``run.resume auto`` chose it and Lightning's full load crashed with
    a traceback on every rerun; the intact checkpoint before it was never used."""
    import io
    import zipfile

    ckpts = tmp_path / "run" / "checkpoints"
    good = fake_checkpoint(ckpts / "step-00000010.ckpt", 10)
    newest = fake_checkpoint(ckpts / "step-00000020.ckpt", 20)
    data = bytearray(newest.read_bytes())
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as archive:
        record = next(i for i in archive.infolist() if i.filename.endswith("/data/0"))
    data[record.header_offset : record.header_offset + 30] = bytes(30)
    newest.write_bytes(bytes(data))
    choice = find_resume_checkpoint(tmp_path / "run")
    assert choice.chosen is not None and choice.chosen.path == good
    assert "step-00000020.ckpt (damaged: its record" in (choice.warning() or "")


def test_step_comes_from_the_checkpoint_not_the_name(tmp_path: Path) -> None:
    ckpts = tmp_path / "run" / "checkpoints"
    fake_checkpoint(ckpts / "epoch=0-step=5.ckpt", 5)
    fake_checkpoint(ckpts / "last.ckpt", 7)  # a plain copy, newer than any step file
    fake_checkpoint(tmp_path / "run" / "hpc_ckpt_1.ckpt", 6)  # Lightning's SLURM requeue save
    choice = find_resume_checkpoint(tmp_path / "run")
    assert choice.chosen is not None and choice.chosen.path.name == "last.ckpt"
    assert choice.warning() is None


def test_weights_only_and_empty_files_are_not_resumable(tmp_path: Path) -> None:
    bad = fake_checkpoint(tmp_path / "a.ckpt", 3, optimizer_states=True)
    assert inspect_checkpoint(bad).error == "missing optimizer_states (weights only?)"
    (tmp_path / "b.ckpt").write_bytes(b"")
    assert inspect_checkpoint(tmp_path / "b.ckpt").error == "empty file"
    torch.save({"w": torch.zeros(2)}, tmp_path / "c.ckpt")
    assert "missing state_dict" in inspect_checkpoint(tmp_path / "c.ckpt").error


def test_only_torn_checkpoints_is_one_error_naming_them(tmp_path: Path) -> None:
    ckpts = tmp_path / "run" / "checkpoints"
    (ckpts).mkdir(parents=True)
    (ckpts / "step-00000002.ckpt").write_bytes(b"PK\x03\x04 half a zip")
    with pytest.raises(ResumeError, match=r"every checkpoint in .* is unreadable") as err:
        resolve_resume("auto", tmp_path / "run")
    assert "step-00000002.ckpt (truncated or not a checkpoint)" in str(err.value)
    assert "run.fresh: true" in str(err.value) and "run.resume" not in str(err.value)[12:]
    assert resolve_resume("auto", tmp_path / "nothing-here") is None
    assert resolve_resume("never", tmp_path / "run") is None


def test_resume_path_and_architecture_checks(tmp_path: Path) -> None:
    ckpt = fake_checkpoint(tmp_path / "x.ckpt", 4)
    assert resolve_resume(str(ckpt), tmp_path, GPT) == str(ckpt)
    # dropout may change on resume; shapes may not
    assert resolve_resume(str(ckpt), tmp_path, {**GPT, "dropout": 0.0}) == str(ckpt)
    with pytest.raises(
        ResumeError, match=r"different model \(model.gpt: n_layer 2 in the checkpoint vs 4 now\)"
    ):
        resolve_resume(str(ckpt), tmp_path, {**GPT, "n_layer": 4})
    with pytest.raises(ResumeError, match="does not exist"):
        resolve_resume(str(tmp_path / "nope.ckpt"), tmp_path)
    (tmp_path / "torn.ckpt").write_bytes(ckpt.read_bytes()[:50])
    with pytest.raises(
        ResumeError, match=r"cannot be resumed from \(truncated or not a checkpoint\)"
    ):
        resolve_resume(str(tmp_path / "torn.ckpt"), tmp_path)


def test_a_null_is_a_change_unless_it_means_from_the_data(tmp_path: Path) -> None:
    """``attention_window: null`` is the whole context, not "as the checkpoint": a windowed run
    resumed or scored without its window is refused. Only vocab_size and eot_id read null as
    "take it from the data", which the checkpoint matches."""
    windowed = {**GPT, "attention_window": 8, "document_mask": True, "eot_id": 0}
    ckpt = fake_checkpoint(tmp_path / "x.ckpt", 4, windowed)
    with pytest.raises(ResumeError, match=r"attention_window 8 in the checkpoint vs null now"):
        resolve_resume(str(ckpt), tmp_path, {**windowed, "attention_window": None})
    from_data = {**windowed, "vocab_size": None, "eot_id": None}
    assert resolve_resume(str(ckpt), tmp_path, from_data) == str(ckpt)


def test_a_folder_is_a_sharded_checkpoint_only_with_its_files(tmp_path: Path) -> None:
    """A folder named with a step counts as a sharded checkpoint only when it holds one (torch
    distributed checkpoint's .metadata, DeepSpeed's *_model_states.pt): a folder holding a
    copied last.ckpt was taken as one and Lightning failed on it with IsADirectoryError."""
    copied = fake_checkpoint(tmp_path / "x" / "step-00000010" / "last.ckpt", 10).parent
    assert "sharded checkpoint's files" in (inspect_checkpoint(copied).error or "")
    (tmp_path / "dcp" / "step-00000010.ckpt").mkdir(parents=True)
    (tmp_path / "dcp" / "step-00000010.ckpt" / ".metadata").write_bytes(b"")
    sharded = inspect_checkpoint(tmp_path / "dcp" / "step-00000010.ckpt")
    # Taken for a sharded checkpoint, and judged as one: without the meta.pt every complete
    # save writes last, it is torn (tests/test_resume_checks.py resumes a real one).
    assert not sharded.ok and "torn: it has no meta.pt" in (sharded.error or "")


def test_a_named_folder_is_read_as_generate_reads_it_or_named_a_folder(tmp_path: Path) -> None:
    """A run directory given to evaluate is its newest complete checkpoint (a step file over
    an equal last.ckpt), and a folder holding a copied last.ckpt is that file, as for generate,
    eval and export; given to resume from, it is named with the file to pass
    (the same command run again continues a run only by the same file); any other folder is
    one line calling it a folder, not "a sharded checkpoint folder without a step in its name"."""
    run = tmp_path / "runs" / "base"
    last = fake_checkpoint(run / "checkpoints" / "last.ckpt", 6)
    step = fake_checkpoint(run / "checkpoints" / "step-00000006.ckpt", 6)
    flag = "--ckpt_path"
    cand = resume_candidate(str(run), tmp_path, GPT, flag, training=False)
    assert cand is not None and cand.path == step and cand.step == 6
    copied = fake_checkpoint(tmp_path / "x" / "step-00000006" / "last.ckpt", 6)
    cand = resume_candidate(str(copied.parent), tmp_path, GPT, flag, training=False)
    assert cand is not None and cand.path == copied
    with pytest.raises(ResumeError) as err:
        resolve_resume(str(run), tmp_path, GPT)
    assert str(err.value) == (
        f"run.resume {run} is a folder, not a checkpoint; pass the checkpoint in it, "
        f"run.resume {step} (to continue that run itself, rerun it with its own run.name "
        "and run.resume auto)"
    )
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(ResumeError) as err:
        resume_candidate(str(tmp_path / "plain"), tmp_path, None, flag, training=False)
    assert str(err.value) == (
        f"--ckpt_path {tmp_path / 'plain'} is a folder without a complete checkpoint "
        "(checkpoints/*.ckpt); pass a .ckpt file"
    )
    last.unlink()  # no last.ckpt (checkpoint.save_last false): its newest step file
    cand = resume_candidate(str(run), tmp_path, None, flag, training=False)
    assert cand is not None and cand.path == step


def test_fit_refuses_a_bad_resume_path_in_one_line(tmp_path: Path, char_dataset: Path) -> None:
    cfg = write_config(tmp_path / "t.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    (tmp_path / "torn.ckpt").write_bytes(b"not a checkpoint")
    res = nanolab_here(
        "fit", "--config", str(cfg), "--run.resume", str(tmp_path / "torn.ckpt"), cwd=tmp_path
    )
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1].startswith("nanolab fit: error: run.resume: ")
    assert not (tmp_path / "runs" / "tiny" / "checkpoints").exists()


# -- preemption handler -------------------------------------------------------------------------
def test_signal_names() -> None:
    assert parse_signals(["SIGTERM", "usr1", "INT", "SIGTERM"]) == [
        signal.SIGTERM, signal.SIGUSR1, signal.SIGINT,
    ]  # fmt: skip
    for bad in ("SIGKILL", "SIGNOPE"):
        with pytest.raises(
            PreemptionConfigError, match=f"preemption.signals: '{bad}' is not a signal"
        ):
            PreemptionHandler(signals=[bad])
    with pytest.raises(PreemptionConfigError, match="exit_code"):
        PreemptionHandler(exit_code=300)


def test_a_signal_ignored_at_launch_stays_ignored_in_training() -> None:
    """`cmd &` in a script starts nanolab with SIGINT ignored; start-up kept it ignored but the
    training loop caught it (a SIGINT then preempted a run that one during start-up did not).
    One rule now: a signal ignored at launch is left ignored; SIGTERM still preempts."""
    trainer = SimpleNamespace(strategy=SimpleNamespace(cluster_environment=None), global_step=0)
    before_int, before_term = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    handler = PreemptionHandler()
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        handler.on_run_start(trainer, None)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == handler._handle
        handler.on_train_end(trainer, None)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        handler._uninstall()
        signal.signal(signal.SIGINT, before_int)
        signal.signal(signal.SIGTERM, before_term)


def test_slurm_auto_requeue_keeps_its_signal(monkeypatch) -> None:
    """Under SLURM auto-requeue, Lightning's SIGUSR1 handler stays; SIGTERM becomes ours."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    env = SLURMEnvironment(auto_requeue=True)
    trainer = SimpleNamespace(strategy=SimpleNamespace(cluster_environment=env), global_step=0)

    def lightning_requeue(signum, frame):  # stands in for Lightning's requeue handler
        pass

    before_usr1 = signal.signal(signal.SIGUSR1, lightning_requeue)
    before_term = signal.getsignal(signal.SIGTERM)
    handler = PreemptionHandler()
    try:
        handler.on_run_start(trainer, None)
        assert signal.getsignal(signal.SIGUSR1) is lightning_requeue
        assert signal.getsignal(signal.SIGTERM) == handler._handle
        handler.on_train_end(trainer, None)
        assert signal.getsignal(signal.SIGTERM) == before_term
        # without SLURM all three are ours
        trainer.strategy.cluster_environment = None
        handler.on_run_start(trainer, None)
        assert signal.getsignal(signal.SIGUSR1) == handler._handle
        handler.on_train_end(trainer, None)
        assert signal.getsignal(signal.SIGUSR1) is lightning_requeue
    finally:
        handler._uninstall()
        signal.signal(signal.SIGUSR1, before_usr1)
        signal.signal(signal.SIGTERM, before_term)


SECOND_SIGNAL = """
import os, signal, sys, time
from types import SimpleNamespace
from nanolab.callbacks.preemption import PreemptionHandler
h = PreemptionHandler(signals=["SIGUSR2"])
h.on_run_start(SimpleNamespace(strategy=SimpleNamespace(), global_step=3), None)
os.kill(os.getpid(), signal.SIGUSR2)
assert h.received == signal.SIGUSR2, "the first signal is only recorded"
print("first signal recorded", flush=True)
os.kill(os.getpid(), signal.SIGUSR2)
time.sleep(30)
sys.exit(0)
"""


def test_second_signal_exits_at_once() -> None:
    res = subprocess.run(
        [sys.executable, "-c", SECOND_SIGNAL],
        capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert res.stdout.strip() == "first signal recorded"
    assert res.returncode == -signal.SIGUSR2, res.stderr
    assert "received SIGUSR2 at step 3" in res.stderr
    assert "second SIGUSR2: exiting now without a checkpoint" in res.stderr


@pytest.mark.slow
def test_preempted_at_an_evaluation_step_keeps_the_evaluation(
    tmp_path: Path, char_dataset: Path
) -> None:
    """Every step evaluates: a SIGTERM lands in a step or an evaluation, either way the run stops
    after that step's evaluation, and the resumed run's log has every evaluation exactly once."""
    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=3000)
    cfg["run"]["eval_every_steps"] = 1
    cfg["checkpoint"] = {"every_n_steps": 1000}
    path = write_config(tmp_path / "t.yaml", cfg)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "nanolab", "fit", "--config", str(path)]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    log = tmp_path / "runs" / "tiny" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while len(read_records(log, "val")) < 3:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 75, proc.stderr.read()[-2000:]
    end = read_records(log, "end")[-1]
    assert end["reason"] == "preempted"
    assert read_records(log, "val")[-1]["step"] == end["step"]
    ckpt = tmp_path / "runs" / "tiny" / "checkpoints" / f"step-{end['step']:08d}.ckpt"
    assert torch.load(ckpt, weights_only=True, mmap=True)["global_step"] == end["step"]
    res = run_nanolab(
        "fit", "--config", str(path), f"--trainer.max_steps={end['step'] + 3}", cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr[-2000:]
    steps = [r["step"] for r in read_records(log, "val")]
    assert steps == list(range(1, end["step"] + 4))


def test_a_signal_during_a_periodic_save_stops_on_that_checkpoint(
    tmp_path: Path, char_dataset: Path
) -> None:
    """A SIGTERM landing inside step 3's periodic checkpoint write (after the step's stop
    decision): the run stops there, on step-3's checkpoint. It trained all of step 4 and saved
    step-4 as well. The resumed run ends bit-identical to a run never stopped. (An
    asynchronous save writes on its own thread while training goes on: a signal then lands in
    the next step, which ends as usual.)"""
    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=6)
    cfg["run"]["eval_every_steps"] = 100
    cfg["checkpoint"] = {"every_n_steps": 1, "keep_last": 10}
    reference = write_config(tmp_path / "ref.yaml", cfg)
    assert nanolab_here("fit", "--config", str(reference), "--run.name", "ref",
                        cwd=tmp_path).returncode == 0  # fmt: skip
    probe = {"class_path": "cli_probes.SignalInSave", "init_args": {"step": 3}}
    signalled = write_config(tmp_path / "sig.yaml", {**cfg, "trainer": {**cfg["trainer"],
                                                                      "callbacks": [probe]}})  # fmt: skip
    proc = nanolab_here("fit", "--config", str(signalled), cwd=tmp_path)
    assert proc.returncode == 75, proc.stderr[-3000:]
    run = tmp_path / "runs" / "tiny"
    end = read_records(run / "metrics.jsonl", "end")[-1]
    assert (end["reason"], end["step"]) == ("preempted", 3)
    assert end["detail"].endswith("step-00000003.ckpt"), end
    assert max(p.name for p in (run / "checkpoints").glob("step-*.ckpt")) == "step-00000003.ckpt"
    resumed = nanolab_here("fit", "--config", str(reference), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ours = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    ref = torch.load(tmp_path / "runs" / "ref" / "checkpoints" / "last.ckpt", weights_only=True)
    assert ours["global_step"] == ref["global_step"] == 6
    for key, tensor in ref["state_dict"].items():
        assert torch.equal(tensor, ours["state_dict"][key]), key
    losses = [(r["step"], r["loss"]) for r in read_records(run / "metrics.jsonl", "train")]
    assert losses == [(r["step"], r["loss"]) for r in read_records(
        tmp_path / "runs" / "ref" / "metrics.jsonl", "train")]  # fmt: skip


def test_fsdp2_resumes_its_own_checkpoint_on_several_devices_but_not_a_plain_one(tmp_path):
    """Lightning writes FSDP2's consolidated optimizer state by parameter index too, and maps it
    back onto the shards by name at load: nanolab's layout record says which strategy wrote the
    file. Mutation caught: refusing every index-keyed state (FSDP2 could not resume its own run
    on the same 2 devices)."""
    import torch

    from nanolab.training.resume import ResumeError, check_sharded_optimizer_layout

    state = {"optimizer_states": [{"state": {0: {"step": torch.tensor(2.0)}}, "param_groups": []}]}
    own = tmp_path / "fsdp2.ckpt"
    torch.save({**state, "nanolab": {"layout": {"world_size": 2, "fsdp2": True}}}, own)
    check_sharded_optimizer_layout(own, "fsdp2", 2)
    plain = tmp_path / "ddp.ckpt"
    torch.save({**state, "nanolab": {"layout": {"world_size": 2, "fsdp2": False}}}, plain)
    with pytest.raises(ResumeError, match="was saved without FSDP2"):
        check_sharded_optimizer_layout(plain, "fsdp2", 2)


def test_a_run_from_another_runs_checkpoint_counts_its_own_hours_not_the_parents(
    tmp_path, char_dataset
):
    """A new run started from another run's checkpoint (a fine-tune, a branch) keeps the
    model's tokens but not the parent's wall time and GPU-hours: those were the parent's, and
    counting them again doubled them in a sum over runs and in the child's budget. Resuming
    the parent itself keeps them. The parent's clock is set to 10,000 s in its checkpoint, so
    the difference cannot be timing."""
    from nanolab.runlog import read_records

    cfg = write_config(tmp_path / "c.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    parent = tmp_path / "runs" / "tiny"
    assert nanolab_here("fit", "--config", str(cfg), cwd=tmp_path).returncode == 0
    ckpt = parent / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, weights_only=True)
    state["callbacks"]["RunClock"].update(elapsed_s=10_000.0, gpu_hours=10_000.0 / 3600)
    torch.save(state, ckpt)
    tokens = state["callbacks"]["RunClock"]["tokens"]

    child = nanolab_here("fit", "--config", str(cfg), "--run.name", "child", "--run.resume",
                         str(ckpt), "--trainer.max_steps", "8", cwd=tmp_path)  # fmt: skip
    assert child.returncode == 0, child.stderr[-2000:]
    (end,) = read_records(tmp_path / "runs" / "child" / "metrics.jsonl", "end")
    assert end["elapsed_s"] < 1_000 and end["gpu_hours"] < 0.3
    first = read_records(tmp_path / "runs" / "child" / "metrics.jsonl", "train")[0]
    assert first["tokens"] > tokens  # the model's tokens go on

    again = nanolab_here("fit", "--config", str(cfg), "--trainer.max_steps", "8", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    ends = read_records(parent / "metrics.jsonl", "end")
    assert ends[-1]["elapsed_s"] > 10_000 and ends[-1]["gpu_hours"] > 10_000 / 3600


def test_the_command_that_started_a_fine_tune_continues_it_after_a_preemption(
    tmp_path, char_dataset
):
    """``fit --run.name child --run.resume PARENT.ckpt`` run again (the retry loop, a requeue,
    the queue) continues the child from its own newest checkpoint; before its first save it
    starts from the parent's checkpoint again as the same run. It was refused as a second run
    in the directory ("would mix two runs"), so a preempted fine-tune could not go on. A third
    run's checkpoint into the child is still refused."""
    cfg = write_config(tmp_path / "c.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    assert nanolab_here("fit", "--config", str(cfg), cwd=tmp_path).returncode == 0
    parent = tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    child = tmp_path / "runs" / "child"

    def fork(steps: int, origin: Path = parent) -> subprocess.CompletedProcess:
        return nanolab_here("fit", "--config", str(cfg), "--run.name", "child", "--run.resume",
                            str(origin), "--trainer.max_steps", str(steps), cwd=tmp_path)  # fmt: skip

    first = fork(8)
    assert first.returncode == 0, first.stderr[-2000:]
    again = fork(10)  # the same command, a longer plan: on from the child's step 8
    assert again.returncode == 0, again.stderr[-2000:]
    assert "holds the run that started from" in again.stderr
    starts = read_records(child / "metrics.jsonl", "start")
    assert [s["resumed_from_step"] for s in starts] == [6, 8]
    assert starts[1]["run_id"] == starts[0]["run_id"]
    assert Path(starts[1]["resumed_from"]).parent == child / "checkpoints"

    for path in (child / "checkpoints").iterdir():
        path.unlink()
    # Its log records saves whose checkpoints are gone: refused, not logged twice.
    lost = fork(10)
    assert lost.returncode == 2 and "are no longer in" in lost.stderr, lost.stderr[-2000:]
    # Killed before the child's first save: its log records no save.
    records = [json.loads(line) for line in (child / "metrics.jsonl").read_text().splitlines()]
    unsaved = [r for r in records if r.get("event") != "checkpoint"]
    (child / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in unsaved))
    restart = fork(10)
    assert restart.returncode == 0, restart.stderr[-2000:]
    starts = read_records(child / "metrics.jsonl", "start")
    assert starts[-1]["resumed_from_step"] == 6 and starts[-1]["run_id"] == starts[0]["run_id"]

    other = tmp_path / "runs" / "other"
    assert (
        nanolab_here("fit", "--config", str(cfg), "--run.name", "other", cwd=tmp_path).returncode
        == 0
    )
    mixed = fork(12, other / "checkpoints" / "last.ckpt")
    assert mixed.returncode == 2 and "would mix two runs" in mixed.stderr


def _run_with_checkpoints_every_2_steps(tmp_path: Path, char_dataset: Path) -> tuple[Path, Path]:
    """An 8-step run keeping its checkpoints of steps 2..8: its config and checkpoint folder."""
    cfg = write_config(
        tmp_path / "c.yaml",
        tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=8,
                       checkpoint__every_n_steps=2, checkpoint__keep_last=5),
    )  # fmt: skip
    assert nanolab_here("fit", "--config", str(cfg), cwd=tmp_path).returncode == 0
    return cfg, tmp_path / "runs" / "tiny" / "checkpoints"


def test_a_resume_from_an_older_checkpoint_sets_the_later_ones_aside(tmp_path, char_dataset):
    """``--run.resume checkpoints/step-4`` of a run that went on to step 8: its saves at steps
    6 and 8 replaced the first timeline's files without a word. They move to ``rolled_back/``
    first (byte for byte), ``last.ckpt`` points at the resumed one, and the line says so."""
    import hashlib

    cfg, folder = _run_with_checkpoints_every_2_steps(tmp_path, char_dataset)

    def digest(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()

    first = {name: digest(folder / name) for name in ("step-00000006.ckpt", "step-00000008.ckpt")}
    again = nanolab_here("fit", "--config", str(cfg), "--run.resume",
                         str(folder / "step-00000004.ckpt"), "--trainer.max_steps", "5", cwd=tmp_path)  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    assert (
        "the 2 later checkpoint(s) (step-00000006.ckpt, step-00000008.ckpt) moved to"
        in again.stderr
    )
    assert {name: digest(folder / "rolled_back" / name) for name in first} == first
    assert not (folder / "step-00000006.ckpt").exists()  # the new timeline stopped at step 5
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == 5


@pytest.mark.parametrize("damage", ["truncated", "pickle of an object"])
def test_checkpoints_auto_skips_as_unreadable_are_set_aside_not_overwritten(
    tmp_path, char_dataset, damage
):
    """``run.resume auto`` skips an unreadable step-6 (and a ``last.ckpt`` with unreadable
    bytes of its own) and resumes from step 4; the resumed run's save at step 6 replaced the
    skipped file without a word. Both move to ``rolled_back/`` byte for byte before training,
    the line printed once they have moved says where, and ``last.ckpt`` is the run's newest
    again. The skip warning says "skipped" only: a resume refused after it moves nothing."""
    import hashlib
    import pickle

    cfg, folder = _run_with_checkpoints_every_2_steps(tmp_path, char_dataset)
    for name in ("step-00000008.ckpt", "last.ckpt"):
        (folder / name).unlink()  # a run that got to step 6
    step6, last = folder / "step-00000006.ckpt", folder / "last.ckpt"
    if damage == "truncated":
        step6.write_bytes(step6.read_bytes()[: step6.stat().st_size // 2])
    else:
        step6.write_bytes(pickle.dumps(SimpleNamespace(step=6)))
    last.write_bytes(pickle.dumps({"global_step": 6}) + b"\0" * 8)
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (step6, last)}
    again = nanolab_here("fit", "--config", str(cfg), "--trainer.max_steps", "9", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    warning = next(ln for ln in again.stderr.splitlines() if "skipped incomplete" in ln)
    assert "step-00000006.ckpt" in warning and "last.ckpt" in warning, warning
    assert "resuming from step-00000004.ckpt (step 4)" in warning, warning
    assert warning.endswith("resuming from step-00000004.ckpt (step 4)"), warning  # no promise
    moved = next(ln for ln in again.stderr.splitlines() if "later checkpoint(s)" in ln)
    assert f"moved to {folder / 'rolled_back'}" in moved, moved  # said once they have moved
    aside = folder / "rolled_back"
    assert {n: hashlib.sha256((aside / n).read_bytes()).hexdigest() for n in before} == before
    assert torch.load(step6, weights_only=True)["global_step"] == 6  # the new save, whole
    assert torch.load(last, weights_only=True)["global_step"] == 9


def test_a_file_named_rolled_back_is_one_line_before_training(tmp_path, char_dataset):
    """``run.resume auto`` skipping an unreadable step-8 must set it aside; a FILE named
    ``rolled_back`` (or a folder nanolab cannot write) was a traceback from inside the fit.
    Now one line naming it and the fix, exit 2, before training: nothing moved or written."""
    cfg, folder = _run_with_checkpoints_every_2_steps(tmp_path, char_dataset)
    step8 = folder / "step-00000008.ckpt"
    step8.write_bytes(step8.read_bytes()[:1000])
    (folder / "rolled_back").write_text("notes\n")
    log = tmp_path / "runs" / "tiny" / "metrics.jsonl"
    before = {p.name: p.read_bytes() for p in [*folder.iterdir(), log]}
    again = nanolab_here("fit", "--config", str(cfg), "--trainer.max_steps", "9", cwd=tmp_path)
    errors = [ln for ln in again.stderr.splitlines() if "error" in ln or "Traceback" in ln]
    assert again.returncode == 2 and len(errors) == 1, again.stderr[-2000:]
    assert errors[0] == (
        f"nanolab fit: error: {folder / 'rolled_back'} is a file, not a folder: nanolab sets "
        "checkpoints newer than the one a run resumes from aside there; rename or remove that "
        "file and launch again"
    )
    assert {p.name: p.read_bytes() for p in [*folder.iterdir(), log]} == before


def test_a_checkpoint_that_cannot_be_set_aside_is_one_line(tmp_path, monkeypatch):
    """A rename refused by the file system (another device, a read-only file) names the
    file, the folder and the fix, as one error line, not an OSError traceback."""
    from nanolab.callbacks.checkpoint import set_aside_newer
    from nanolab.errors import RunConfigError

    for step in (2, 4):
        (tmp_path / f"step-{step:08d}.ckpt").write_bytes(b"x")

    def refuse(self: Path, target: Path) -> None:
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(Path, "rename", refuse)
    with pytest.raises(RunConfigError) as caught:
        set_aside_newer(tmp_path, tmp_path / "step-00000002.ckpt", 2)
    assert str(caught.value) == (
        f"cannot move {tmp_path / 'step-00000004.ckpt'} to {tmp_path / 'rolled_back'} (Invalid "
        f"cross-device link): the run's saves would overwrite it; move it out of {tmp_path} "
        f"yourself (or make {tmp_path / 'rolled_back'} writable) and launch again"
    )


def test_a_resume_that_fails_to_restore_sets_nothing_aside(tmp_path, char_dataset):
    """The later checkpoints move aside once the resume has restored: a resume from an older
    checkpoint refused during the restore (another data.align) left the run rewound, and the
    next ``auto`` resume quietly redid the steps from the older one."""
    cfg, folder = _run_with_checkpoints_every_2_steps(tmp_path, char_dataset)
    before = sorted(p.name for p in folder.iterdir())
    refused = nanolab_here("fit", "--config", str(cfg), "--run.resume", str(folder / "step-00000004.ckpt"),
                           "--data.align", "document", "--data.micro_batch_size", "1", "--trainer.max_steps", "9", cwd=tmp_path)  # fmt: skip
    assert refused.returncode == 2 and "data.align is document" in refused.stderr
    assert sorted(p.name for p in folder.iterdir()) == before
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == 8


@pytest.mark.parametrize(("rank", "said"), [(0, True), (1, False)])
def test_a_signal_is_announced_once_per_launch(capfd, rank, said):
    """Every rank of a DDP launch may get the signal (a group signal): only global rank 0 says
    so, so one signal is one line, not one per process."""
    handler = PreemptionHandler()
    handler._stepped = True  # past the first step: no start-up watchdog
    handler._trainer = SimpleNamespace(global_rank=rank, global_step=14, strategy=None)
    handler._handle(signal.SIGTERM, None)
    assert handler.received is signal.SIGTERM
    err = capfd.readouterr().err
    assert ("received SIGTERM at step 14" in err) is said, err


@pytest.mark.parametrize(
    ("done", "step_ended", "stop", "said"),
    [
        (5, False, None, "step 6 is the run's last: completing it (exit 0)"),  # training step 6
        (6, True, None, "step 6 is the run's last: completing it (exit 0)"),  # step 6's save
        (5, True, None, "saving a checkpoint, then exiting with code 75"),  # step 5's save
        (4, False, None, "saving a checkpoint, then exiting with code 75"),
        (4, True, "budget", "the budget rule ends the run at step 4: completing it (exit 0)"),
    ],
)
def test_a_signal_at_the_runs_last_step_says_the_run_completes(capfd, done, step_ended, stop, said):
    """A signal the run will not preempt on (its last step, or a budget or plateau stop: it
    completes and exits 0, docs/resume.md) said it would save and exit 75."""
    handler = PreemptionHandler()
    handler._stepped, handler._step_ended = True, step_ended
    trainer = SimpleNamespace(global_rank=0, global_step=done, max_steps=6, strategy=None)
    if stop:
        set_stop_reason(trainer, stop, "max_wall_hours")
    handler._trainer = trainer
    handler._handle(signal.SIGTERM, None)
    err = capfd.readouterr().err
    assert f"received SIGTERM at step {done}: " in err and said in err, err


def test_rank_0_keeps_a_first_signal_and_ends_its_ranks_only_on_a_second() -> None:
    """A copy of rank 0's first signal reached a rank that a group signal had reached already
    as its second, and that rank died without a checkpoint; a second signal to rank 0 SIGKILLs
    the ranks it launched (test_second_signal_exits_at_once runs that path in a process)."""
    sent: list[signal.Signals] = []
    launcher = SimpleNamespace(kill=sent.append)  # Lightning's launcher: signals its children
    handler = PreemptionHandler()
    handler._stepped = True
    handler._trainer = SimpleNamespace(
        global_rank=0, global_step=14, strategy=SimpleNamespace(launcher=launcher)
    )
    handler._handle(signal.SIGTERM, None)
    assert handler.received is signal.SIGTERM and sent == []
    handler._end_launched_ranks()
    assert sent == [signal.SIGKILL]


def _launch_ddp_group(tmp_path: Path, name: str, cfg: dict) -> tuple[subprocess.Popen, Path]:
    """``nanolab fit`` of ``cfg`` on 2 CPU processes (DDP), in a process group of its own (so
    ``os.killpg`` signals every process, as ``timeout`` and SLURM do); output in ``<name>.log``."""
    config = write_config(tmp_path / f"{name}.yaml", cfg)
    ddp = Path(__file__).resolve().parents[1] / "configs" / "strategy" / "ddp.yaml"
    log = tmp_path / f"{name}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "nanolab", "fit", "--config", str(config), "--config",
             str(ddp), "--trainer.devices", "2"],
            cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
    return proc, log


def _signal_group_and_wait(proc: subprocess.Popen, log: Path) -> str:
    """SIGTERM to every process of the launch (as ``timeout`` does), its exit code asserted 75
    (SIGKILL to what is left if it does not end); the launch's output."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert code == 75, text[-3000:]
    return text


@pytest.mark.slow  # a real 2-process run signalled as a group (~15 s); the rank-0 test above is the default proof
def test_a_signal_to_the_whole_process_group_of_a_ddp_run_saves_and_exits_75(
    tmp_path: Path, char_dataset: Path
) -> None:
    """GNU ``timeout``, ``kill -- -PGID`` and SLURM signal every process of a launch. Rank 0
    used to forward its signal to the rank it started, which took that copy as a second signal
    and died: a crash (exit 1 or 137), no checkpoint, end reason ``error``."""
    cfg = tiny_overrides(
        char_dataset, tmp_path / "runs", trainer__max_steps=100000,
        run__name="group", run__eval_every_steps=1000, checkpoint__every_n_steps=1000,
    )  # fmt: skip
    proc, log = _launch_ddp_group(tmp_path, "group", cfg)
    run_dir = tmp_path / "runs" / "group"
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "metrics.jsonl").exists() or not any(
            r["step"] >= 3 for r in read_records(run_dir / "metrics.jsonl", "train")
        ):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no train record"
            time.sleep(0.05)
    except BaseException:
        if proc.poll() is None:  # no leftover launch when the wait itself failed
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    text = _signal_group_and_wait(proc, log)
    assert "second SIGTERM" not in text and "Traceback" not in text, text[-3000:]
    end = read_records(run_dir / "metrics.jsonl", "end")[-1]
    assert end["reason"] == "preempted", end
    assert (run_dir / "checkpoints" / f"step-{end['step']:08d}.ckpt").exists()


@pytest.mark.slow
def test_a_group_signal_while_a_ddp_run_starts_its_ranks_exits_75(
    tmp_path: Path, char_dataset: Path
) -> None:
    """Rank 0 waits in the rendezvous for the rank it launched; that rank, signalled in its own
    start-up, used to exit 75 alone, and Lightning's launcher took that for a crash and SIGKILLed
    rank 0 (exit 137, a run folder holding only its lock). It now holds the signal to the first
    step's start, where both ranks stop together."""
    cfg = tiny_overrides(
        char_dataset, tmp_path / "runs", trainer__max_steps=100000,
        run__name="starting",
    )  # fmt: skip
    proc, log = _launch_ddp_group(tmp_path, "starting", cfg)
    try:
        deadline = time.monotonic() + 300
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        while True:  # until the launched rank catches SIGTERM: its start-up has begun
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no launched rank"
            pids = children.read_text().split() if children.exists() else []
            status = [Path(f"/proc/{pid}/status") for pid in pids]
            caught = [
                line.split()[1]
                for path in status if path.exists()
                for line in path.read_text().splitlines() if line.startswith("SigCgt:")
            ]  # fmt: skip
            if any(int(mask, 16) >> (signal.SIGTERM - 1) & 1 for mask in caught):
                break
            time.sleep(0.01)
    except BaseException:
        if proc.poll() is None:  # no leftover launch when the wait itself failed
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    text = _signal_group_and_wait(proc, log)
    assert "Forcefully terminating" not in text and "Traceback" not in text, text[-3000:]


@pytest.mark.parametrize(
    ("settings", "record", "said"),
    [
        ({"optimizer": {"name": "muon"}}, {}, "model.optimizer.name is 'muon' but the checkpoint "
         "was trained with 'adamw'; resume with --model.optimizer.name adamw"),
        ({"freeze": {"blocks": 1}}, {"freeze": {"embeddings": False, "blocks": 0}},
         "x.ckpt was trained with model.freeze.blocks 0 (this run: 1)"),
    ],
)  # fmt: skip
def test_a_restore_of_ones_own_meets_fits_rule_for_the_optimizer_state(settings, record, said):
    """A ``Trainer.fit(ckpt_path=...)`` of one's own (no ``nanolab fit``, which refuses earlier)
    meets the rule ``nanolab fit`` and ``queue add`` refuse by when the module restores the
    checkpoint: one line naming the setting, not torch's parameter-group error.

    Mutation caught: the module's check of its own (optimizer name only) dropped or drifted
    from the rule."""
    from nanolab.model.config import ConfigError
    from nanolab.training.freeze import FreezeConfig
    from nanolab.training.module import GPTLightningModule
    from nanolab.training.optim import OptimizerConfig

    module = GPTLightningModule(
        optimizer=OptimizerConfig(**settings.get("optimizer", {})),
        freeze=FreezeConfig(**settings.get("freeze", {})),
    )
    module._trainer = SimpleNamespace(state=SimpleNamespace(fn="fit"), ckpt_path="x.ckpt",
                                      global_rank=0)  # fmt: skip
    checkpoint = {"optimizer_states": [{}], "nanolab": {"optimizer": {"name": "adamw"}, **record}}
    with pytest.raises(ConfigError) as err:
        module.on_load_checkpoint(checkpoint)
    assert said in str(err.value)


def test_a_preemption_that_saved_nothing_says_why() -> None:
    """``save_now`` saves nothing when the run's stop forbids saving the state (a loss spike's)
    as well as when the parameters are not finite; the preemption line said the latter in
    both cases."""
    from types import SimpleNamespace

    from nanolab.callbacks.events import set_stop_reason
    from nanolab.callbacks.preemption import unsaved_because

    trainer = SimpleNamespace(should_stop=False)
    assert unsaved_because(trainer) == "parameters not finite"
    set_stop_reason(trainer, "rollback", "loss spike", save_state=False)
    assert unsaved_because(trainer) == "the rollback stop forbids saving this state"
