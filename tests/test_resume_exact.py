"""Kill a run anywhere, resume it, and get the very same weights as a run that was never killed.

The run is a real ``nanolab fit`` subprocess on CPU in fp32 with dropout (so the RNG matters),
warmup + cosine LR, AdamW and gradient accumulation 2 (so the accumulation boundary matters),
checkpointing every optimizer step, and a callback drawing from Python's and NumPy's global RNGs
every micro-batch (as augmentation code in a fork would). One chain of processes is interrupted
in every way a night can interrupt it: SIGKILL right after a checkpoint, SIGKILL inside a
checkpoint write (the process is paused there by ``cli_probes.PauseInSave``, so the kill lands
mid-save every time), SIGKILL at a random moment, a checkpoint torn mid-write (the file cut short
by hand, plus a stray ``.tmp`` as an atomic writer would leave), and a graceful SIGTERM (exit 75,
checkpoint at the step boundary). The final state dict, optimizer state, LR scheduler, loop
counters and the torch, Python and NumPy RNG states must equal the uninterrupted run's exactly.

Mutations caught: ``restore_rng_state`` not restoring the Python and NumPy states (their final
states differ); an ``atomic_torch_save`` writing straight to the final name (the paused save
is not a ``.tmp`` file and the torn final file is left under the checkpoint's name).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from nanolab.data.prepare import prepare_dataset
from nanolab.training.resume import find_resume_checkpoint

STEPS = 24
MICRO_BATCH, BLOCK = 4, 32
ACCUMULATE = 2

CONFIG = """\
seed_everything: 1234
run:
  root: {root}
  global_batch_tokens: {tokens}
  eval_every_steps: 5
trainer:
  accelerator: cpu
  devices: 1
  precision: 32-true
  max_steps: {steps}
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: cli_probes.DrawsFromEveryRng
    - class_path: cli_probes.PauseInSave
checkpoint:
  every_n_steps: 1
  keep_last: 3
model:
  gpt:
    block_size: {block}
    n_layer: 2
    n_head: 2
    n_embd: 48
    dropout: 0.2
  optimizer:
    lr: 3.0e-3
  schedule:
    warmup_steps: 4
    min_lr_ratio: 0.1
data:
  dataset_dir: {data}
  source: null
  micro_batch_size: {micro}
  val_windows: 8
"""


def write_config(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    prepare_dataset(["bundled:shakespeare"], data, "chars", 4096, 0.1)
    cfg = tmp_path / "exact.yaml"
    cfg.write_text(
        CONFIG.format(
            root=tmp_path / "runs",
            tokens=MICRO_BATCH * BLOCK * ACCUMULATE,
            steps=STEPS,
            block=BLOCK,
            data=data,
            micro=MICRO_BATCH,
        )
    )
    return cfg


TESTS = Path(__file__).resolve().parent


def launch(cfg: Path, name: str, log: Path, pause_save: str | None = None) -> subprocess.Popen:
    """``nanolab fit`` as a user runs it; ``pause_save`` = ``<step>:<marker>`` freezes it inside
    that step's checkpoint write (see ``cli_probes.PauseInSave``)."""
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    env["PYTHONPATH"] = path
    if pause_save:
        env["NANOLAB_PROBE_PAUSE_SAVE"] = pause_save
    cmd = [sys.executable, "-m", "nanolab", "fit", "--config", str(cfg), "--run.name", name]
    return subprocess.Popen(
        cmd, stdout=log.open("a"), stderr=subprocess.STDOUT, env=env, cwd=cfg.parent
    )


def newest_named_step(run_dir: Path) -> int:
    """Largest step in a checkpoint file name (complete or not), -1 when there is none."""
    steps = [-1]
    for p in (run_dir / "checkpoints").glob("step-*.ckpt"):
        steps.append(int(p.name[5:13]))
    return max(steps)


def wait_for_checkpoint(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while newest_named_step(run_dir) < step:
        assert proc.poll() is None, f"run exited ({proc.returncode}) before step {step}"
        assert time.monotonic() < deadline, f"no checkpoint of step {step} after {timeout}s"
        time.sleep(0.005)


def kill(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> int:
    proc.send_signal(sig)
    return proc.wait(timeout=120)


def final_checkpoint(run_dir: Path) -> dict:
    choice = find_resume_checkpoint(run_dir)
    assert choice.chosen is not None and choice.chosen.step == STEPS, choice
    return torch.load(choice.chosen.path, map_location="cpu", weights_only=True)


def assert_identical(a: dict, b: dict) -> None:
    """Bit-identical training state: weights, AdamW moments, schedule, counters, RNG."""
    assert a["global_step"] == b["global_step"] == STEPS
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for k, t in a["state_dict"].items():
        assert torch.equal(t, b["state_dict"][k]), f"weight {k} differs"
    oa, ob = a["optimizer_states"][0], b["optimizer_states"][0]
    assert oa["state"].keys() == ob["state"].keys()
    for i, st in oa["state"].items():
        for k, t in st.items():
            assert torch.equal(torch.as_tensor(t), torch.as_tensor(ob["state"][i][k])), (
                f"optimizer state {i}.{k} differs"
            )
    assert [g["lr"] for g in oa["param_groups"]] == [g["lr"] for g in ob["param_groups"]]
    assert a["lr_schedulers"] == b["lr_schedulers"]
    pa = a["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]
    pb = b["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]
    assert pa == pb and pa["processed"] == STEPS * ACCUMULATE
    ra, rb = a["nanolab"]["rng"], b["nanolab"]["rng"]
    assert torch.equal(ra["torch"], rb["torch"]), "torch RNG state differs"
    assert ra["python"] == rb["python"], "Python RNG state differs"
    kind_a, keys_a, *rest_a = ra["numpy"]
    kind_b, keys_b, *rest_b = rb["numpy"]
    assert kind_a == kind_b and rest_a == rest_b and torch.equal(keys_a, keys_b), (
        "NumPy RNG state differs"
    )
    # The streams were used: neither is still where seed_everything left it.
    seeded = np.random.RandomState(1234).get_state()
    assert not (np.array_equal(keys_a.numpy(), seeded[1]) and rest_a[0] == seeded[2])
    assert list(ra["python"][1]) != list(random.Random(1234).getstate()[1])


def wait_for_file(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"run exited ({proc.returncode}) before {path.name} appeared"
        assert time.monotonic() < deadline, f"no {path.name} after {timeout}s"
        time.sleep(0.01)


def surviving_timeline(log: Path) -> dict[int, dict]:
    """Train records by step, the last copy of each (a resume redoes steps after its checkpoint)."""
    from nanolab.runlog import read_records

    return {r["step"]: r for r in read_records(log, "train")}


def check_log_continuity(killed_log: Path, reference_log: Path) -> None:
    """Each resume continues right after its checkpoint, and the surviving timeline of the killed
    run logs the very same losses and token counts as the uninterrupted run."""
    from nanolab.runlog import read_records

    records = read_records(killed_log)
    starts = [i for i, r in enumerate(records) if r["event"] == "start"]
    assert len(starts) == 5 and records[starts[0]]["resumed_from_step"] is None
    for i in starts[1:]:
        resumed = records[i]["resumed_from_step"]
        first_train = next(r for r in records[i:] if r["event"] == "train")
        assert first_train["step"] == resumed + 1, (resumed, first_train["step"])
    ends = [r for r in records if r["event"] == "end"]
    assert [e["reason"] for e in ends] == ["preempted", "completed"]
    assert records[-1]["event"] == "end"
    ours, ref = surviving_timeline(killed_log), surviving_timeline(reference_log)
    assert sorted(ours) == sorted(ref) == list(range(1, STEPS + 1))
    for step in ref:
        assert ours[step]["loss"] == ref[step]["loss"], f"loss differs at step {step}"
        assert ours[step]["tokens"] == ref[step]["tokens"], f"tokens differ at step {step}"
        assert ours[step]["lr"] == ref[step]["lr"], f"lr differs at step {step}"
    val = {r["step"]: r["val_loss"] for r in read_records(killed_log, "val")}
    ref_val = {r["step"]: r["val_loss"] for r in read_records(reference_log, "val")}
    assert val == ref_val


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kill_anywhere_then_resume_is_bit_identical(tmp_path: Path) -> None:
    seed = int(os.environ.get("NANOLAB_KILL_SEED", time.time_ns() % 100_000))
    rng = random.Random(seed)
    print(f"kill points drawn with NANOLAB_KILL_SEED={seed}")
    cfg = write_config(tmp_path)
    runs = tmp_path / "runs"
    killed = runs / "killed"
    log = tmp_path / "killed.log"

    reference = launch(cfg, "reference", tmp_path / "reference.log")

    # 1. SIGKILL as soon as a checkpoint appears (the process is then a step or so further).
    proc = launch(cfg, "killed", log)
    wait_for_checkpoint(killed, rng.randint(2, 4), proc)
    assert kill(proc) == -signal.SIGKILL

    # 2. SIGKILL inside a checkpoint write: the process is paused between writing the bytes and
    #    the fsync + rename. Only the temporary file may exist; the step before stays newest.
    paused_step = newest_named_step(killed) + 2
    marker = tmp_path / "paused-in-save"
    proc = launch(cfg, "killed", log, pause_save=f"{paused_step}:{marker}")
    wait_for_file(marker, proc)
    assert kill(proc) == -signal.SIGKILL
    final = killed / "checkpoints" / f"step-{paused_step:08d}.ckpt"
    written = Path(marker.read_text())  # a new file of the save's own: .<name>.<random>.tmp
    assert written.parent == final.parent and written.name.startswith(f".{final.name}.")
    assert written.name.endswith(".tmp") and written.is_file() and not final.exists()
    assert newest_named_step(killed) == paused_step - 1

    # 3. SIGKILL at a random moment a few steps later (mid-step, mid-accumulation, mid-save).
    proc = launch(cfg, "killed", log)
    wait_for_checkpoint(killed, newest_named_step(killed) + rng.randint(1, 3), proc)
    time.sleep(rng.uniform(0.0, 0.15))
    assert kill(proc) == -signal.SIGKILL
    assert newest_named_step(killed) < STEPS, "the run finished before it could be killed"

    # 4. A checkpoint torn mid-write by a writer that is not atomic: the newest file cut short
    #    by hand (last.ckpt, a hard link to it, with it), plus a stray temporary file. Resume
    #    must report and skip them and use the one before.
    newest = max((killed / "checkpoints").glob("step-*.ckpt"), key=lambda p: p.name)
    torn_step = int(newest.name[5:13])
    data = newest.read_bytes()
    newest.write_bytes(data[: rng.randint(1, len(data) - 1)])
    (newest.parent / f"step-{torn_step + 1:08d}.ckpt.tmp").write_bytes(data[: len(data) // 3])
    proc = launch(cfg, "killed", log)
    # ...and that run is preempted gracefully: SIGTERM at a random moment -> it finishes the
    # optimizer step, checkpoints, and exits 75.
    wait_for_checkpoint(killed, torn_step + rng.randint(1, 3), proc)
    time.sleep(rng.uniform(0.0, 0.1))
    assert kill(proc, signal.SIGTERM) == 75, log.read_text()[-2000:]
    text = log.read_text()
    warning = next(ln for ln in text.splitlines() if "skipped incomplete or corrupt" in ln)
    assert newest.name in warning and f"step-{torn_step - 1:08d}.ckpt" in warning, warning
    assert "preempted by SIGTERM after step" in text
    assert newest_named_step(killed) < STEPS

    # 5. Resume to the end.
    proc = launch(cfg, "killed", log)
    assert proc.wait(timeout=300) == 0, log.read_text()[-2000:]
    assert reference.wait(timeout=300) == 0, (tmp_path / "reference.log").read_text()[-2000:]

    assert_identical(final_checkpoint(runs / "reference"), final_checkpoint(killed))
    check_log_continuity(killed / "metrics.jsonl", runs / "reference" / "metrics.jsonl")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_resume_with_loader_workers_is_bit_identical(tmp_path: Path) -> None:
    """The same run with ``data.num_workers: 2`` (persistent workers, started again by the
    resumed process at its first validation): SIGKILL after a checkpoint past the first
    evaluation, resume, and every weight, moment and RNG state equals the uninterrupted run's.
    Mutation caught: loaders drawing their workers' seed from the global torch RNG (dropout
    parted from the reference right after the resumed run's first evaluation)."""
    cfg = write_config(tmp_path)
    cfg.write_text(
        cfg.read_text().replace("  val_windows: 8\n", "  val_windows: 8\n  num_workers: 2\n")
    )
    runs = tmp_path / "runs"
    reference = launch(cfg, "reference", tmp_path / "reference.log")
    assert reference.wait(timeout=300) == 0, (tmp_path / "reference.log").read_text()[-2000:]
    log = tmp_path / "killed.log"
    proc = launch(cfg, "killed", log)
    wait_for_checkpoint(runs / "killed", 7, proc)  # after the evaluation at step 5
    assert kill(proc) == -signal.SIGKILL
    assert newest_named_step(runs / "killed") < STEPS
    proc = launch(cfg, "killed", log)
    assert proc.wait(timeout=300) == 0, log.read_text()[-2000:]
    assert_identical(final_checkpoint(runs / "reference"), final_checkpoint(runs / "killed"))
