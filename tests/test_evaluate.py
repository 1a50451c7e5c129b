"""``nanolab validate`` / ``nanolab test`` evaluate what the run trained (docs/evaluate.md).

One tiny run is trained once; each test copies it, evaluates it through the real CLI and checks
the number printed against the one the fit logged for the same checkpoint, the record appended to
metrics.jsonl, and that nothing else in the run directory changed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import nanolab_here, run_nanolab, tiny_overrides, write_config

from nanolab.runlog import read_records


@pytest.fixture(scope="module")
def trained(tmp_path_factory, char_dataset) -> Path:
    """A finished 6-step run (validation at steps 3 and 6; a checkpoint at each)."""
    root = tmp_path_factory.mktemp("trained")
    overrides = tiny_overrides(char_dataset, Path("runs"))  # relative: copies stay self-contained
    overrides["checkpoint"] = {"every_n_steps": 3, "keep_last": 5}
    cfg = write_config(root / "tiny.yaml", overrides)
    res = nanolab_here("fit", "--config", str(cfg), cwd=root)  # in-process: set-up only
    assert res.returncode == 0, res.stderr[-3000:]
    return root


@pytest.fixture
def work(trained, tmp_path) -> Path:
    shutil.copytree(trained, tmp_path / "w")
    return tmp_path / "w"


def digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def fit_val_loss(run: Path, step: int) -> float:
    vals = [r for r in read_records(run / "metrics.jsonl", "val") if r.get("evaluated_by") is None]
    return [r["val_loss"] for r in vals if r["step"] == step][-1]


def test_validate_evaluates_the_newest_checkpoint_and_logs_it(work):
    run = work / "runs" / "tiny"
    log_before = (run / "metrics.jsonl").read_bytes()
    before = digests(work)
    res = nanolab_here("validate", "--config", "tiny.yaml", cwd=work)
    assert res.returncode == 0, res.stderr[-3000:]
    # The trained model's loss, not a fresh one's: the same number the fit logged at step 6.
    record = read_records(run / "metrics.jsonl")[-1]
    assert record["event"] == "val" and record["evaluated_by"] == "nanolab validate"
    assert record["step"] == 6 == torch.load(run / "checkpoints" / "last.ckpt")["global_step"]
    assert record["val_loss"] == pytest.approx(fit_val_loss(run, 6), abs=1e-5)
    assert f"{record['val_loss']:.4f}"[:5] in res.stdout
    # Appended: every earlier byte of the log and every other file is as it was.
    assert (run / "metrics.jsonl").read_bytes().startswith(log_before)
    after = digests(work)
    changed = sorted(k for k in before if after.get(k) != before[k])
    assert changed == ["runs/tiny/metrics.jsonl"]
    assert sorted(set(after) - set(before)) == []  # the lock file is gone again


@pytest.mark.slow  # three CLI runs: ~25 s on 2 cores
def test_a_folder_given_as_the_checkpoint_is_read_as_generate_reads_it(work):
    """A run directory, or a step-named folder a checkpoint was copied into, is its last.ckpt
    (the folder was taken for a sharded checkpoint: an IsADirectoryError traceback, exit 1);
    any other folder is one line naming it a folder, exit 2. Printed, not logged: a path."""
    run = work / "runs" / "tiny"
    copy = work / "x" / "step-00000006"
    copy.mkdir(parents=True)
    shutil.copy(run / "checkpoints" / "last.ckpt", copy / "last.ckpt")
    before = digests(work)
    for given, file in (
        ("runs/tiny", "runs/tiny/checkpoints/step-00000006.ckpt"),
        ("x/step-00000006", "x/step-00000006/last.ckpt"),
    ):
        res = run_nanolab("validate", "--config", "tiny.yaml", "--ckpt_path", given, cwd=work)
        assert res.returncode == 0, res.stderr[-3000:]
        assert f"{fit_val_loss(run, 6):.4f}"[:5] in res.stdout
        # The line names the file scored, not the folder given.
        assert f"nanolab validate: {file} (step 6), on the validation windows" in res.stdout
    assert digests(work) == before
    res = run_nanolab("validate", "--config", "tiny.yaml", "--ckpt_path", "x", cwd=work)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1] == (
        "nanolab validate: error: --ckpt_path x is a folder without a complete checkpoint "
        "(checkpoints/*.ckpt); "
        "pass a .ckpt file"
    )


@pytest.mark.slow
def test_test_best_picks_the_lowest_logged_validation_loss(work):
    run = work / "runs" / "tiny"
    vals = {s: fit_val_loss(run, s) for s in (3, 6)}
    best_step = min(vals, key=vals.get)
    res = run_nanolab("test", "--config", "tiny.yaml", "--ckpt_path", "best", cwd=work)
    assert res.returncode == 0, res.stderr[-3000:]
    record = read_records(run / "metrics.jsonl")[-1]
    assert record["event"] == "test" and record["step"] == best_step
    assert record["checkpoint"].endswith(f"step-{best_step:08d}.ckpt")
    # test and val read the same held-out windows here: the loss the fit logged at that step.
    assert record["test_loss"] == pytest.approx(vals[best_step], abs=1e-5)


@pytest.mark.slow  # 30-100 s on 2 cores; `pytest -m slow`
def test_an_untrained_model_is_refused_unless_asked_for(work):
    res = run_nanolab("validate", "--config", "tiny.yaml", "--run.name", "never-trained", cwd=work)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    last = [ln for ln in res.stderr.splitlines() if ln.strip()][-1]
    assert "holds no checkpoint to validate" in last and "--ckpt_path none" in last
    assert not (work / "runs" / "never-trained").exists()

    before = digests(work)
    res = run_nanolab(
        "validate", "--config", "tiny.yaml", "--run.name", "never-trained",
        "--ckpt_path", "none", cwd=work,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert "val/loss" in res.stdout
    assert digests(work) == before  # printed only: there is no run to log it to


@pytest.mark.slow
def test_a_live_fit_keeps_its_log_to_itself(work):
    """While another process holds the run directory the result is printed, not appended."""
    run = work / "runs" / "tiny"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from nanolab.callbacks.runlock import acquire; "
            f"acquire({str(run)!r}); print('held', flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        log_before = (run / "metrics.jsonl").read_bytes()
        res = run_nanolab("validate", "--config", "tiny.yaml", cwd=work)
        assert res.returncode == 0, res.stderr[-3000:]
        warned = [line for line in res.stderr.splitlines() if "not logging" in line]
        assert len(warned) == 1 and "is in use by" in warned[0], res.stderr[-3000:]
        assert warned[0].startswith("nanolab validate: warning: not logging to runs/tiny: ")
        assert "UserWarning" not in res.stderr and "compose.py" not in res.stderr
        assert "val/loss" in res.stdout
        assert (run / "metrics.jsonl").read_bytes() == log_before
    finally:
        holder.kill()
        holder.wait()


def test_an_evaluation_on_other_data_or_windows_is_printed_not_logged_to_the_run(work):
    """``validate --data.dataset_dir OTHER`` of the run's checkpoint appended a ``val`` record
    to the run's log with nothing naming the data, and ``report`` took it for the run's val
    loss. Other data, or other validation windows, is printed and named, not logged."""
    run = work / "runs" / "tiny"
    prepared = nanolab_here("prepare", "bundled:shakespeare", "-o", "other", "--tokenizer",
                            "chars", "--val-fraction", "0.3", cwd=work)  # fmt: skip
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    log_before = (run / "metrics.jsonl").read_bytes()
    other = nanolab_here(
        "validate", "--config", "tiny.yaml", "--data.dataset_dir", "other", cwd=work
    )
    assert other.returncode == 0, other.stderr[-3000:]
    assert "not logged to" in other.stderr and "other data than the run's" in other.stderr
    assert "val/loss" in other.stdout
    windows = nanolab_here("validate", "--config", "tiny.yaml", "--data.val_windows", "4", cwd=work)
    assert windows.returncode == 0, windows.stderr[-3000:]
    assert "data.val_windows is 4, the run validates on 16" in windows.stderr
    assert (run / "metrics.jsonl").read_bytes() == log_before
    same = nanolab_here("validate", "--config", "tiny.yaml", cwd=work)  # its own: logged
    assert same.returncode == 0 and read_records(run / "metrics.jsonl")[-1]["event"] == "val"


@pytest.mark.parametrize("verb", ["validate", "test", "eval"])
def test_a_run_replaced_during_the_evaluation_is_not_credited_with_it(work, monkeypatch, verb):
    """``fit --run.fresh true`` replacing the run while its checkpoint was scored (the old run
    moved to ``previous/``): the old checkpoint's record was appended after the new run's
    ``end``, and ``report`` credited the old model's scores to the new run. With the lock held
    for the append, the log must still name the run that was scored; it does not: one
    warning, and neither log changes."""
    from nanolab.callbacks import runlock

    run = work / "runs" / "tiny"
    old_log = (run / "metrics.jsonl").read_bytes()
    new_log = b'{"event":"start","time":1.0,"run_id":"0123456789ab"}\n{"event":"end","step":3}\n'
    real_acquire, replaced = runlock.acquire, []

    def replace_then_acquire(run_dir, **how):  # a fresh fit ran between the pick and the append
        if not replaced:
            (work / "runs" / "previous").mkdir()
            run.rename(work / "runs" / "previous" / "tiny")
            run.mkdir()
            (run / "metrics.jsonl").write_bytes(new_log)
            replaced.append(run_dir)
        return real_acquire(run_dir, **how)

    monkeypatch.setattr(runlock, "acquire", replace_then_acquire)
    if verb == "eval":
        argv = ["runs/tiny", "--suite", "builtin:shakespeare", "--limit", "4", "--device", "cpu"]
    else:
        argv = ["--config", "tiny.yaml"]
    res = nanolab_here(verb, *argv, cwd=work)
    assert res.returncode == 0, res.stderr[-3000:]
    assert replaced, "the evaluation took no lock to append its record"
    warned = [line for line in res.stderr.splitlines() if "not logged" in line]
    assert warned == [
        f"nanolab {verb}: warning: not logged: runs/tiny now holds another run (its log names "
        f"run 0123456789ab; the checkpoint evaluated is run {read_records_id(old_log)}'s)"
    ], res.stderr[-3000:]
    assert (run / "metrics.jsonl").read_bytes() == new_log
    assert (work / "runs" / "previous" / "tiny" / "metrics.jsonl").read_bytes() == old_log


@pytest.mark.parametrize(
    ("verb", "what"), [("validate", "dir"), ("test", "dir"), ("eval", "dir"), ("eval", "log")]
)
def test_a_run_moved_or_deleted_during_the_evaluation_is_not_made_again(
    work, monkeypatch, verb, what
):
    """The run directory moved (or its log deleted) while its checkpoint was scored: taking the
    lock for the append made the directory again, with a lone ``metrics.jsonl`` holding the
    record, and ``status`` then listed that folder as a running run. Now nothing is created:
    one warning, the scores printed, exit 0 (as for a run replaced meanwhile)."""
    from nanolab.callbacks import evaluation_log

    run, moved = work / "runs" / "tiny", work / "runs" / "tiny.moved"
    real_append = evaluation_log.append_evaluation

    def move_then_append(run_dir, *args):  # after the scoring, before the record is written
        if what == "dir":
            run.rename(moved)
        else:
            (run / "metrics.jsonl").unlink()
        return real_append(run_dir, *args)

    monkeypatch.setattr(evaluation_log, "append_evaluation", move_then_append)
    if verb == "eval":
        argv = ["runs/tiny", "--suite", "builtin:shakespeare", "--limit", "4", "--device", "cpu"]
    else:
        argv = ["--config", "tiny.yaml"]
    before = digests(work)
    res = nanolab_here(verb, *argv, cwd=work)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    warned = [line for line in res.stderr.splitlines() if "not logg" in line]
    if what == "dir":
        assert warned == [
            f"nanolab {verb}: warning: not logged: the run directory runs/tiny is gone (moved or "
            "deleted while it was scored); the scores are printed only"
        ], res.stderr[-3000:]
        assert not run.exists()
        moved_files = {k.replace("tiny.moved", "tiny", 1): v for k, v in digests(work).items()}
        assert moved_files == before
    else:
        assert warned == [
            f"nanolab {verb}: warning: not logged: runs/tiny has no metrics.jsonl (moved or "
            "deleted?); a record alone there would read as a run of its own"
        ], res.stderr[-3000:]
        assert not (run / "metrics.jsonl").exists()
    assert ("val/loss" if verb == "validate" else "test/loss" if verb == "test" else "acc") in (
        res.stdout
    )
    status = nanolab_here("status", cwd=work)
    assert "running" not in status.stdout.split("ended")[0].replace("running (0)", ""), (
        status.stdout
    )


def read_records_id(log: bytes) -> str:
    """The run id of a log's first (``start``) record."""
    import json

    return json.loads(log.splitlines()[0])["run_id"]


@pytest.mark.parametrize("case", ["lower-cased", "more-chars"])
def test_data_of_another_tokenizer_is_refused_before_it_is_scored(work, case):
    """A chars model on lower-cased chars data (a smaller vocabulary, so every id fits the
    model) scored and exited 0; data with characters the run never saw (a larger vocabulary)
    was told to set model.gpt.vocab_size, which does not apply to a checkpoint. Both are the
    tokenizer line ``fit --model.init_from`` gives, exit 2, and nothing is logged."""
    import gzip

    run = work / "runs" / "tiny"
    corpus = Path(__file__).parents[1] / "nanolab" / "data" / "corpus" / "shakespeare.txt.gz"
    with gzip.open(corpus, "rt") as f:
        text = f.read(200_000)
    (work / "text").mkdir()
    other = text.lower() if case == "lower-cased" else text + "\nÉté à Noël\n"
    (work / "text" / "t.txt").write_text(other, encoding="utf-8")
    prepared = nanolab_here("prepare", "text", "-o", "other", "--workers", "1", "-q", cwd=work)
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    log_before = (run / "metrics.jsonl").read_bytes()
    res = nanolab_here("validate", "--config", "tiny.yaml", "--data.dataset_dir", "other", cwd=work)
    assert res.returncode == 2, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nanolab validate: error: data.dataset_dir"), (
        lines
    )
    assert "not the checkpoint's tokenizer 'chars' in" in lines[0] and "vocab_size" not in lines[0]
    assert "is id 3 in the data, id 4 in the checkpoint" in lines[0]  # the first difference
    assert "val/loss" not in res.stdout
    assert (run / "metrics.jsonl").read_bytes() == log_before


def poisoned(src: Path, dst: Path) -> None:
    """``src`` with one NaN in its token embedding (tied to the output layer: 2 tensors),
    written to ``dst`` as a fresh file (never through a hard link into another name)."""
    ckpt = torch.load(src, weights_only=True)
    ckpt["state_dict"]["model.wte.weight"][0, 0] = float("nan")
    dst.unlink(missing_ok=True)
    torch.save(ckpt, dst)


@pytest.mark.parametrize(
    ("verb", "given", "scored"),
    [
        ("validate", "nan.ckpt", "nan.ckpt"),
        ("test", "last", "runs/tiny/checkpoints/"),
        ("validate", "best", "runs/tiny/checkpoints/step-"),
        ("test", "runs/tiny", "runs/tiny/checkpoints/step-"),
    ],
)
def test_a_checkpoint_with_non_finite_weights_is_refused_in_evals_words(work, verb, given, scored):
    """validate/test scored a checkpoint holding NaN weights, printed ``val/loss  -`` and
    exited 0 (and for ``last``/``best`` logged the NaN record to the run). Each way of naming
    it (a file, ``last``, ``best``, a run directory) is refused before the model runs, in the
    line generate/eval/export give for the same file, exit 2, the run left as it was."""
    run = work / "runs" / "tiny"
    poisoned(run / "checkpoints" / "last.ckpt", work / "nan.ckpt")
    for ckpt in (run / "checkpoints").glob("*.ckpt"):
        poisoned(ckpt, ckpt)
    before = digests(work)
    res = nanolab_here(verb, "--config", "tiny.yaml", "--ckpt_path", given, cwd=work)
    assert res.returncode == 2, (res.stdout, res.stderr[-2000:])
    stage = "val" if verb == "validate" else "test"
    assert "Traceback" not in res.stderr and f"{stage}/loss" not in res.stdout
    line = res.stderr.strip().splitlines()[-1]
    prefix = f"nanolab {verb}: error: "
    assert line.startswith(prefix + scored), line
    path = line[len(prefix) :].split(" has ", 1)[0]  # the file it resolved to: generate's words
    generate = nanolab_here("generate", "--ckpt", path, "--prompt", "a", cwd=work)
    assert generate.returncode == 2, generate.stderr[-2000:]
    assert (
        generate.stderr.strip().splitlines()[-1]
        == f"nanolab generate: error: {line[len(prefix) :]}"
    )
    assert "has non-finite weights (NaN/inf in 2 of" in line
    assert digests(work) == before  # nothing logged, nothing written


def test_validate_restores_the_checkpoint_mapped_on_the_cpu(work, monkeypatch):
    """The optimizer's state (AdamW: twice the weights) is for training: an evaluation that
    read it held three times the weights in memory beside the model (and, on a GPU, put it
    back on the device). Mapped on the CPU it costs nothing until read, so it stays in the
    dict a fork's ``on_load_checkpoint`` sees. The record is the same as the full restore's."""
    from nanolab.training.module import GPTLightningModule

    seen: list[tuple[set[str], set[str]]] = []
    restore = GPTLightningModule.on_load_checkpoint

    def spy(self, checkpoint):
        seen.append((set(checkpoint), {t.device.type for t in checkpoint["state_dict"].values()}))
        return restore(self, checkpoint)

    loads: list[bool] = []
    load = torch.load

    def load_spy(*args, **kwargs):
        loads.append(bool(kwargs.get("mmap")))
        return load(*args, **kwargs)

    monkeypatch.setattr(GPTLightningModule, "on_load_checkpoint", spy)
    monkeypatch.setattr(torch, "load", load_spy)
    res = nanolab_here("validate", "--config", "tiny.yaml", cwd=work)
    assert res.returncode == 0, res.stderr[-3000:]
    ((keys, devices),) = seen
    assert "state_dict" in keys and devices == {"cpu"}
    assert {"optimizer_states", "lr_schedulers"} <= keys, keys  # a fork's hook may read them
    assert loads and all(loads), loads  # every read of the checkpoint maps it
    run = work / "runs" / "tiny"
    record = read_records(run / "metrics.jsonl")[-1]
    assert record["evaluated_by"] == "nanolab validate" and record["step"] == 6
    assert record["val_loss"] == pytest.approx(fit_val_loss(run, 6), abs=1e-5)


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads Linux's /proc")
def test_an_evaluation_load_pays_for_the_optimizer_state_only_when_read(tmp_path):
    """The optimizer's state stays in the loaded checkpoint (a fork's hook may read it), mapped:
    the load itself does not bring its bytes into memory."""
    from nanolab.training.evaluate import load_for_evaluation

    moments = 32 * 2**20  # 128 MiB of float32
    ckpt = tmp_path / "step-00000001.ckpt"
    state = {0: {"exp_avg": torch.ones(moments)}}
    torch.save({"state_dict": {"w": torch.ones(4)}, "optimizer_states": [{"state": state}]}, ckpt)
    del state
    before = _rss_bytes()
    loaded = load_for_evaluation(ckpt)
    assert _rss_bytes() - before < 16 * 2**20
    exp_avg = loaded["optimizer_states"][0]["state"][0]["exp_avg"]
    assert exp_avg.device.type == "cpu" and float(exp_avg.sum()) == moments


def test_an_evaluation_load_leaves_shards_and_other_loaders_their_own(tmp_path):
    from lightning.fabric.plugins.io import TorchCheckpointIO
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from nanolab.callbacks.checkpoint_io import (
        AtomicCheckpointIO,
        EvaluationCheckpointIO,
        evaluation_loads,
    )
    from nanolab.training.evaluate import load_for_evaluation

    ckpt = tmp_path / "step-00000001.ckpt"
    weights = {"w": torch.arange(4.0)}
    full = {"state_dict": weights, "global_step": 1, "optimizer_states": [{"m": torch.ones(4)}],
            "lr_schedulers": [{"last_epoch": 1}]}  # fmt: skip
    torch.save(full, ckpt)
    legacy = tmp_path / "legacy.ckpt"  # torch's old format cannot be mapped: read as it is
    torch.save(full, legacy, _use_new_zipfile_serialization=False)
    for path in (ckpt, legacy):
        loaded = load_for_evaluation(path)
        assert set(loaded) == set(full) and loaded["state_dict"]["w"].equal(weights["w"])

    class ShardedLoad(SingleDeviceStrategy):  # DeepSpeed, FSDP: a load of their own
        def load_checkpoint(self, checkpoint_path, weights_only=None):
            raise AssertionError("not called here")

    class OtherStorage(TorchCheckpointIO):  # a checkpoint IO of one's own
        pass

    for make, path, lean in [
        (lambda: SingleDeviceStrategy("cpu"), ckpt, True),
        (lambda: SingleDeviceStrategy("cpu", checkpoint_io=AtomicCheckpointIO()), ckpt, True),
        (lambda: SingleDeviceStrategy("cpu"), tmp_path, False),  # a sharded folder
        (lambda: SingleDeviceStrategy("cpu"), None, False),  # --ckpt_path none
        (lambda: SingleDeviceStrategy("cpu"), "s3://bucket/x.ckpt", False),  # not a local file
        (lambda: ShardedLoad("cpu"), ckpt, False),
        (lambda: SingleDeviceStrategy("cpu", checkpoint_io=OtherStorage()), ckpt, False),
    ]:
        strategy = make()
        before = strategy.checkpoint_io
        with evaluation_loads(strategy, None if path is None else str(path)):
            assert isinstance(strategy.checkpoint_io, EvaluationCheckpointIO) == lean, (path, lean)
        assert strategy.checkpoint_io is before
