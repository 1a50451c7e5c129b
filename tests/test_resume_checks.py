"""What a resume checks in a checkpoint before anything loads it: a sharded folder's pickles are
data (torch and DeepSpeed unpickle them unrestricted), a folder is complete, the chosen file's
bytes pass their CRC-32s, the opening leaves no mapping of the file behind, and a change of
precision is said."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import QUICKSTART, nanolab_here, run_nanolab, tiny_overrides, write_config

from nanolab.model.checkpoint import CheckpointError, load_checkpoint, sharded_folder_problem
from nanolab.runlog import read_records
from nanolab.training.resume import (
    ResumeError,
    find_resume_checkpoint,
    inspect_checkpoint,
    resume_candidate,
)


class _Payload:
    """A pickle that creates ``marker`` when unpickled: what a hostile checkpoint would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _real_dcp_folder(folder: Path) -> Path:
    """A torch distributed checkpoint as Lightning's FSDP2 save leaves it: torch's own index
    and shards (written by torch, one process) and Lightning's ``meta.pt``."""
    import torch.distributed.checkpoint as dcp

    state = {"state_dict": {"model.w": torch.ones(4, 3)}, "optimizer_0": {"lr": 0.1}}
    dcp.save(state, checkpoint_id=folder, no_dist=True)
    torch.save({"global_step": 10, "loops": {}, "lr_schedulers": []}, folder / "meta.pt")
    return folder


def _hostile_dcp_folder(folder: Path, marker: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    (folder / "__0_0.distcp").write_bytes(b"junk")
    torch.save({"global_step": 10}, folder / "meta.pt")
    return folder


def test_a_dcp_folder_whose_index_runs_code_is_refused_before_torch_reads_it(tmp_path):
    """Its ``.metadata`` was unpickled by torch under fit (a given path and auto) and validate:
    the payload ran. Now it is read with an unpickler that resolves only what a distributed
    checkpoint's index holds: refused in one line (auto: skipped, named), nothing runs; a real
    one passes."""
    marker = tmp_path / "PWNED"
    run = tmp_path / "run"
    _real_dcp_folder(run / "checkpoints" / "step-00000004.ckpt")
    hostile = _hostile_dcp_folder(run / "checkpoints" / "step-00000010.ckpt", marker)
    assert sharded_folder_problem(run / "checkpoints" / "step-00000004.ckpt") is None
    for training in (True, False):  # fit, validate/test
        with pytest.raises(ResumeError) as err:
            resume_candidate(str(hostile), run, None, training=training)
        assert "\n" not in str(err.value) and "posix.system" in str(err.value), err.value
    choice = find_resume_checkpoint(run)
    assert choice.chosen is not None and choice.chosen.path.name == "step-00000004.ckpt"
    assert "step-00000010.ckpt (its .metadata names posix.system" in (choice.warning() or "")
    assert not marker.exists()


def test_a_deepspeed_folder_holding_a_pickle_payload_is_refused(tmp_path):
    """DeepSpeed loads every ``.pt`` of its folder with ``weights_only=False``: each is read
    with ``weights_only=True`` first (DeepSpeed's own few classes allowed)."""
    marker = tmp_path / "PWNED"
    folder = tmp_path / "step-00000010.ckpt" / "checkpoint"
    folder.mkdir(parents=True)
    torch.save({"module": {"w": torch.ones(2)}}, folder / "mp_rank_00_model_states.pt")
    torch.save({"loss": _Payload(marker)}, folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(ResumeError, match=r"it holds a pickled \w+\.system, which") as err:
        resume_candidate(str(folder.parent), tmp_path, None)
    assert "\n" not in str(err.value) and not marker.exists()
    (folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    assert sharded_folder_problem(folder.parent) is None


def test_a_torn_dcp_folder_is_skipped_under_auto_and_refused_when_named(tmp_path):
    """An interrupted copy: ``.metadata`` without ``meta.pt`` (or without a shard it indexes)
    was picked and ended in rank tracebacks; it is named and skipped, as a torn file is."""
    run = tmp_path / "run"
    _real_dcp_folder(run / "checkpoints" / "step-00000004.ckpt")
    torn = _real_dcp_folder(run / "checkpoints" / "step-00000008.ckpt")
    (torn / "meta.pt").unlink()
    short = _real_dcp_folder(run / "checkpoints" / "step-00000006.ckpt")
    next(short.glob("*.distcp")).write_bytes(b"")
    choice = find_resume_checkpoint(run)
    assert choice.chosen is not None and choice.chosen.path.name == "step-00000004.ckpt"
    line = choice.warning() or ""
    assert "step-00000008.ckpt (torn: it has no meta.pt" in line, line
    assert "step-00000006.ckpt (torn: its shard" in line, line
    with pytest.raises(ResumeError, match=r"cannot be resumed from \(torn: it has no meta\.pt"):
        resume_candidate(str(torn), run, None)


@pytest.mark.slow
def test_fit_refuses_a_hostile_fsdp_folder_and_resumes_a_real_one(tmp_path, char_dataset):
    """Through the CLI, 2 processes under FSDP2 with distributed saves: the hostile folder
    given is one line, exit 2, nothing run; put in the run it is skipped, and the run resumes
    from its real sharded checkpoint."""
    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=2)
    cfg["checkpoint"] = {"every_n_steps": 2}
    config = write_config(tmp_path / "t.yaml", cfg)
    fsdp = [
        "--config", str(QUICKSTART.parent / "strategy" / "fsdp.yaml"), "--trainer.devices", "2",
        "--trainer.strategy.init_args.save_distributed_checkpoint", "true",
    ]  # fmt: skip
    base = ["fit", "--config", str(QUICKSTART), "--config", str(config), *fsdp]
    marker = tmp_path / "PWNED"
    hostile = _hostile_dcp_folder(tmp_path / "evd" / "step-00000010.ckpt", marker)
    res = run_nanolab(*base, "--run.resume", str(hostile), cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert len(res.stderr.strip().splitlines()) == 1 and "posix.system" in res.stderr
    assert not marker.exists()
    res = run_nanolab(*base, "--run.resume", "never", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    saved = tmp_path / "runs" / "tiny" / "checkpoints" / "step-00000002.ckpt"
    assert saved.is_dir() and sharded_folder_problem(saved) is None
    shutil.copytree(hostile, saved.parent / "step-00000010.ckpt")
    res = run_nanolab(*base, "--trainer.max_steps", "4", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "skipped incomplete or corrupt checkpoint(s): step-00000010.ckpt" in res.stderr
    assert "resuming from step-00000002.ckpt (step 2)" in res.stderr
    assert (saved.parent / "step-00000004.ckpt").is_dir() and not marker.exists()
    # Its section is read from meta.pt: a resume under another optimizer is refused in one
    # line before the strategy loads the shards (where it was torch's traceback).
    from nanolab.training.resume import optimizer_state_problem

    section = inspect_checkpoint(saved).nanolab
    assert section is not None and section["optimizer"]["name"] == "adamw"
    said = optimizer_state_problem(section, "sgdm", None, saved)
    assert said is not None and "trained with 'adamw'" in said


def _fit(tmp_path: Path, char_dataset: Path, *extra: str) -> Path:
    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=4)
    cfg["checkpoint"] = {"every_n_steps": 2}
    config = write_config(tmp_path / "t.yaml", cfg)
    res = nanolab_here("fit", "--config", str(QUICKSTART), "--config", str(config), *extra,
                       cwd=tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    return tmp_path / "runs" / "tiny"


def _mapped(path: Path, pid: int | str = "self") -> bool:
    return any(str(path) in line for line in Path(f"/proc/{pid}/maps").read_text().splitlines())


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")
def test_the_resume_check_leaves_no_mapping_of_the_checkpoint(tmp_path, char_dataset):
    """The check kept the checkpoint's RNG tensors (views of its memory map) for the run's
    lifetime: the file stayed mapped after rotation deleted it, its space never freed, and the
    advised rerun after a full disk filled it again (exit 74)."""
    run = _fit(tmp_path, char_dataset)
    cand = resume_candidate("auto", run, None)
    assert cand is not None and cand.nanolab and cand.nanolab.get("rng")
    assert not _mapped(cand.path.resolve())


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")
def test_a_resumed_run_frees_the_checkpoint_it_resumed_from(tmp_path, char_dataset):
    """A real resumed fit with keep_last 1: once rotation has deleted the file it resumed from,
    no process of the run maps it (``(deleted)`` in /proc/PID/maps before)."""
    run = _fit(tmp_path, char_dataset)
    first = (run / "checkpoints" / "step-00000004.ckpt").resolve()
    argv = [sys.executable, "-m", "nanolab", "fit", "--config", str(QUICKSTART), "--config",
            str(tmp_path / "t.yaml"), "--trainer.max_steps", "4000", "--checkpoint.keep_last",
            "1", "--checkpoint.keep_best", "0", "--run.eval_every_steps", "100000"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while first.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert not first.exists() and proc.poll() is None, "rotation never deleted it"
        time.sleep(0.5)
        assert not any(f"{first} (deleted)" in line for line in
                       Path(f"/proc/{proc.pid}/maps").read_text().splitlines())  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(60)


def _flip_tensor_byte(path: Path) -> str:
    """Flip one byte inside a tensor record, headers untouched (a bad sector); its name."""
    with zipfile.ZipFile(path) as archive:
        info = max(
            (i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size
        )
    start = info.header_offset + 30 + len(info.orig_filename.encode()) + len(info.extra)
    data = bytearray(path.read_bytes())
    data[start + info.file_size // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return info.filename


def test_a_checkpoint_whose_bytes_fail_their_crc_is_skipped_or_refused(tmp_path, char_dataset):
    """A flipped bit inside a tensor leaves every header in place: the run resumed from it,
    logged val nan and stopped as diverged, advising a lower LR. The chosen file's records are
    now checked against their CRC-32s: auto skips it (one line naming it), a given path and
    generate/eval/export are refused in one line."""
    run = _fit(tmp_path, char_dataset)
    newest = run / "checkpoints" / "step-00000004.ckpt"
    (run / "checkpoints" / "last.ckpt").unlink()
    record = _flip_tensor_byte(newest)
    assert inspect_checkpoint(newest).ok  # the cheap opening cannot see it
    choice = find_resume_checkpoint(run, verify=True)
    assert choice.chosen is not None and choice.chosen.path.name == "step-00000002.ckpt"
    assert f"step-00000004.ckpt (damaged: its record {record} fails its CRC-32 check)" in (
        choice.warning() or ""
    )
    for training in (True, False):
        with pytest.raises(ResumeError, match="fails its CRC-32 check") as err:
            resume_candidate(str(newest), run, None, training=training)
        assert "\n" not in str(err.value)
    with pytest.raises(CheckpointError, match="fail their CRC-32"):
        load_checkpoint(newest)


def test_a_resume_under_another_precision_says_so(tmp_path, char_dataset):
    """32-true -> bf16-mixed was taken with no word and config.yaml then named bf16-mixed for
    a run that trained most steps in fp32: one line says it."""
    _fit(tmp_path, char_dataset, "--trainer.precision", "32-true")
    config = tmp_path / "t.yaml"
    # In a process of its own: its warnings go to its stderr whatever loggers earlier tests
    # of this process left configured.
    res = run_nanolab("fit", "--config", str(QUICKSTART), "--config", str(config),
                      "--trainer.precision", "bf16-mixed", "--trainer.max_steps", "6",
                      cwd=tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [ln for ln in res.stderr.splitlines() if "trainer.precision 32-true" in ln]
    assert len(lines) == 1 and "its steps up to 4 trained in 32-true" in lines[0], res.stderr
    res = run_nanolab("fit", "--config", str(QUICKSTART), "--config", str(config),
                      "--trainer.precision", "bf16-mixed", "--trainer.max_steps", "8",
                      cwd=tmp_path)  # fmt: skip
    assert res.returncode == 0 and "saved at trainer.precision" not in res.stderr  # same now


def test_another_model_freeze_on_a_resume_or_a_branch_is_one_line_before_anything_is_written(
    tmp_path, char_dataset
):
    """Freezing other parameters changes what the optimizer state is for: it was Lightning's
    traceback ("a parameter group that doesn't match the size of optimizer's group"), exit 1."""
    run = _fit(tmp_path, char_dataset)
    base = ("fit", "--config", str(QUICKSTART), "--config", str(tmp_path / "t.yaml"))
    log, config = (run / "metrics.jsonl").read_bytes(), (run / "config.yaml").read_bytes()
    res = nanolab_here(*base, "--trainer.max_steps", "6", "--model.freeze.embeddings", "true",
                       cwd=tmp_path)  # fmt: skip
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    (line,) = [ln for ln in res.stderr.splitlines() if "model.freeze" in ln]
    assert "model.freeze.embeddings false (this run: true)" in line
    assert "--model.freeze.embeddings false" in line and "--model.init_from" in line
    assert (run / "metrics.jsonl").read_bytes() == log
    assert (run / "config.yaml").read_bytes() == config
    # A new run from the run's checkpoint: refused the same way, its directory never made.
    res = nanolab_here(*base, "--run.name", "br", "--run.resume", str(run / "checkpoints" /
                       "last.ckpt"), "--model.freeze.blocks", "1", cwd=tmp_path)  # fmt: skip
    assert res.returncode == 2 and "model.freeze.blocks 0 (this run: 1)" in res.stderr
    assert not (run.parent / "br").exists()
    # A checkpoint saved before the record of its freeze: told by its optimizer state's size.
    newest = run / "checkpoints" / "step-00000004.ckpt"
    state = torch.load(newest, weights_only=True)
    del state["nanolab"]["freeze"]
    torch.save(state, newest)
    res = nanolab_here(*base, "--trainer.max_steps", "6", "--model.freeze.blocks", "1",
                       cwd=tmp_path)  # fmt: skip
    assert res.returncode == 2 and "trainable parameter tensors" in res.stderr, res.stderr
    assert (run / "metrics.jsonl").read_bytes() == log


def test_a_resume_that_changes_dropout_clipping_or_val_windows_says_each(tmp_path, char_dataset):
    """They were taken without a word, and config.yaml then claimed the new value for the whole
    run: one line each says up to which step the old one held; the run log keeps both."""
    run = _fit(tmp_path, char_dataset, "--trainer.gradient_clip_val", "1.0")
    base = ("fit", "--config", str(QUICKSTART), "--config", str(tmp_path / "t.yaml"))
    changed = ("--model.gpt.dropout", "0.3", "--trainer.gradient_clip_val", "0.5",
               "--data.val_windows", "8")  # fmt: skip
    res = nanolab_here(*base, *changed, "--trainer.max_steps", "6", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    said = [
        ln for ln in res.stderr.splitlines() if ln.startswith("nanolab: warning: resuming with")
    ]
    assert len(said) == 3, res.stderr
    assert "model.gpt.dropout 0.3: its steps up to 4 trained with 0.0" in said[0]
    assert "--model.gpt.dropout 0.0" in said[0]
    assert "trainer.gradient_clip_val 0.5: its steps up to 4 trained with 1.0" in said[1]
    assert "data.val_windows 8: its evaluations up to step 4 scored 16 windows" in said[2]
    starts = [r["config"] for r in read_records(run / "metrics.jsonl", "start")]
    assert [c["model"]["gpt"]["dropout"] for c in starts] == [0.0, 0.3]
    assert [c["trainer"]["gradient_clip_val"] for c in starts] == [1.0, 0.5]
    assert [c["data"]["val_windows"] for c in starts] == [16, 8]
    # The same values again: nothing to say.
    res = nanolab_here(*base, *changed, "--trainer.max_steps", "8", cwd=tmp_path)
    assert res.returncode == 0 and "resuming with" not in res.stderr, res.stderr[-2000:]
    # A launch with clipping 1.0 resumed from step 8 and was killed before it saved (its start
    # record is the newest at step 8): the values step 8 trained with are the saving launch's,
    # so resuming with them again says nothing (it said "trained with 1.0": a false line whose
    # advice undid the user's choice).
    killed = read_records(run / "metrics.jsonl", "start")[-1]
    killed["config"]["trainer"]["gradient_clip_val"] = 1.0
    with open(run / "metrics.jsonl", "a") as log:
        log.write(json.dumps({**killed, "step": 8}) + "\n")
    res = nanolab_here(*base, *changed, "--trainer.max_steps", "10", cwd=tmp_path)
    assert res.returncode == 0 and "resuming with" not in res.stderr, res.stderr[-2000:]


class _ByName:
    """Pickles as ``getattr(owner, name)``, as some Python builds pickle an enum member."""

    def __init__(self, owner: object, name: str) -> None:
        self.owner, self.name = owner, name

    def __reduce__(self):
        return getattr, (self.owner, self.name)


def test_an_index_holding_an_enum_member_by_name_is_read_and_other_getattrs_refused() -> None:
    """A clean install's Python pickled the index's memory-format enum member as
    ``getattr(_MEM_FORMAT_ENCODING, 'TORCH_CONTIGUOUS_FORMAT')`` and the folder check refused a
    real FSDP2 checkpoint; getattr is read only for a member of an enum the index may hold,
    never to reach another attribute (``Path.home``, a path to a callable)."""
    import io
    from pathlib import PosixPath

    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    from nanolab.model.checkpoint import _IndexUnpickler

    member = _ByName(_MEM_FORMAT_ENCODING, "TORCH_CONTIGUOUS_FORMAT")
    read = _IndexUnpickler(io.BytesIO(pickle.dumps(member))).load()
    assert read is _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    for payload in (_ByName(PosixPath, "home"), _ByName(_MEM_FORMAT_ENCODING, "__init__")):
        with pytest.raises(pickle.UnpicklingError, match=r"builtins\.getattr"):
            _IndexUnpickler(io.BytesIO(pickle.dumps(payload))).load()


def test_a_run_whose_checkpoints_are_gone_is_not_started_over_in_its_own_log(
    tmp_path, char_dataset
):
    """The checkpoints folder deleted, the same command trained from step 0 again into the same
    run log (steps 1..4 twice; report counted a resume). It is refused in one line naming the
    run, the last logged step and what works, with nothing written; the fixes it names work, and
    a run that stopped before its first step still starts again in place."""
    run = _fit(tmp_path, char_dataset)
    config = tmp_path / "t.yaml"
    # With its checkpoints in place, run.resume never gets the claim's line, not this one.
    args = ("fit", "--config", str(QUICKSTART), "--config", str(config))
    res = nanolab_here(*args, "--run.resume", "never", cwd=tmp_path)
    assert res.returncode == 2 and "with checkpoints (step-00000004.ckpt" in res.stderr
    assert "no longer in" not in res.stderr, res.stderr[-2000:]
    shutil.rmtree(run / "checkpoints")
    log = (run / "metrics.jsonl").read_bytes()
    args = ("fit", "--config", str(QUICKSTART), "--config", str(config))
    for extra in ((), ("--run.resume", "never")):
        res = nanolab_here(*args, *extra, cwd=tmp_path)
        assert res.returncode == 2, res.stderr[-2000:]
        (line,) = [ln for ln in res.stderr.splitlines() if "error:" in ln]
        assert f"run directory {run} holds a run logged up to step 4" in line, line
        assert "checkpoints (the newest of step 4) are no longer in" in line, line
        assert "run.fresh: true" in line, line
        assert "another run.name" in line and "Traceback" not in res.stderr
        assert (run / "metrics.jsonl").read_bytes() == log  # nothing appended
        assert not (run / "checkpoints").exists() and not (run / "previous").exists()
    res = nanolab_here(*args, "--run.fresh", "true", cwd=tmp_path)  # what the line says works
    assert res.returncode == 0, res.stderr[-2000:]
    (kept,) = (run / "previous").iterdir()
    assert (kept / "metrics.jsonl").read_bytes() == log

    # Trained steps and no checkpoint saved (killed hard before its first save, then retried):
    # nothing to lose, it starts again in place.
    shutil.rmtree(run / "checkpoints")
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    unsaved = [ln for ln in lines if json.loads(ln).get("event") != "checkpoint"]
    assert len(unsaved) < len(lines) and json.loads(unsaved[-1]).get("step") == 4
    (run / "metrics.jsonl").write_text("".join(unsaved))
    res = nanolab_here(*args, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]

    # A log holding a start record and no trained step (it failed before step 1): it restarts.
    shutil.rmtree(run / "checkpoints")
    start = (run / "metrics.jsonl").read_text().splitlines()[0]
    end = {"event": "end", "step": 0, "reason": "exception"}
    (run / "metrics.jsonl").write_text(start + "\n" + json.dumps(end) + "\n")
    res = nanolab_here(*args, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]


def test_a_branch_whose_checkpoints_are_gone_is_not_started_over_in_its_own_log(
    tmp_path, char_dataset
):
    """A run branched from another run's checkpoint (``run.resume PATH``), its checkpoints
    deleted, rerun with the same command: it started from the parent's checkpoint again into
    its own log (steps twice). Refused in one line whose fixes suit a branch (run.fresh takes
    no checkpoint); a branch killed before its first save still starts again."""
    parent = _fit(tmp_path, char_dataset)
    branch_cmd = (
        "fit", "--config", str(QUICKSTART), "--config", str(tmp_path / "t.yaml"),
        "--run.name", "br", "--trainer.max_steps", "8",
        "--run.resume", str(parent / "checkpoints" / "step-00000002.ckpt"),
    )  # fmt: skip
    res = nanolab_here(*branch_cmd, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    branch = tmp_path / "runs" / "br"
    log = (branch / "metrics.jsonl").read_bytes()
    shutil.rmtree(branch / "checkpoints")
    res = nanolab_here(*branch_cmd, cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-2000:]
    (line,) = [ln for ln in res.stderr.splitlines() if "error:" in ln]
    assert f"run directory {branch} holds a run logged up to step 8" in line, line
    assert "branch from" in line and "under another run.name" in line, line
    assert "run.fresh" not in line and "Traceback" not in res.stderr
    assert (branch / "metrics.jsonl").read_bytes() == log

    # Killed before its first save (no checkpoint record): it starts again from the parent's.
    records = [json.loads(ln) for ln in log.decode().splitlines()]
    kept = [r for r in records if r.get("event") != "checkpoint" and r.get("step", 0) <= 3]
    (branch / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    res = nanolab_here(*branch_cmd, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]


def test_a_checkpoint_without_nanolab_s_record_is_not_said_to_be_adamw() -> None:
    """A sharded folder's ``nanolab`` section is read only when the strategy loads it: before
    that, ``fit``'s refusal and ``queue add --continue`` have no record of its optimizer and
    compare nothing (the module compares what it restores); a section without an optimizer
    record predates it and is AdamW's.

    Mutation caught: a missing section read as AdamW, refusing every sharded checkpoint trained
    with another optimizer ("the checkpoint was trained with 'adamw'")."""
    from types import SimpleNamespace

    from nanolab.queue.jobs import _optimizer_state_problem
    from nanolab.run.compose import refuse_other_optimizer_state
    from nanolab.training.resume import optimizer_state_problem

    folder = Path("runs/fs/checkpoints/step-00000002.ckpt")
    assert optimizer_state_problem(None, "sgdm", None, folder) is None
    said = optimizer_state_problem({}, "sgdm", None, folder)
    assert said is not None and "trained with 'adamw'" in said
    cand = SimpleNamespace(path=folder, nanolab=None)
    model = SimpleNamespace(optimizer_config=SimpleNamespace(name="sgdm"), freeze_config=None)
    refuse_other_optimizer_state(cand, model)  # no error: nothing is known to differ
    assert _optimizer_state_problem(cand, {"optimizer": {"name": "sgdm"}}) is None
