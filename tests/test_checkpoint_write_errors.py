"""A checkpoint write the system refuses: the line names the cause and what is left of the
run's checkpoints (the earlier ones, or none yet), never a promise of files that do not exist."""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import pytest

SAVE_UNDER_A_LIMIT = """
import resource, sys, torch
from nanolab.callbacks.checkpoint_io import CheckpointWriteError, atomic_torch_save
resource.setrlimit(resource.RLIMIT_FSIZE, (100 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    atomic_torch_save({"w": torch.zeros(100_000)}, sys.argv[1])
except CheckpointWriteError as err:
    print(err)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="ulimit -f is a POSIX limit")
def test_a_save_past_ulimit_f_names_the_limit_and_that_no_checkpoint_exists_yet(
    tmp_path: Path,
) -> None:
    """It said "File too large; the previous checkpoints are intact ...; check the
    filesystem" for a run's first save."""
    target = tmp_path / "checkpoints" / "step-00000001.ckpt"
    out = subprocess.run(
        [sys.executable, "-c", SAVE_UNDER_A_LIMIT, str(target)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == (
        f"could not write checkpoint {target}: file too large: this process's file-size limit "
        "(ulimit -f: 0.10 MB) is below the checkpoint's size (at least 0.40 MB); no checkpoint "
        "was saved yet (no partial file was left under the final name); raise the limit "
        "(ulimit -f unlimited, or ask for it in the job's settings)"
    )
    assert list(target.parent.iterdir()) == []


def test_the_lines_say_whether_earlier_checkpoints_are_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nanolab.callbacks import checkpoint_io

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    target = folder / "step-00000004.ckpt"
    monkeypatch.setattr(checkpoint_io, "file_size_limit", lambda: None)
    size = checkpoint_io.CheckpointSize
    big = checkpoint_io._explain(OSError(errno.EFBIG, "File too large"), target, size(5 * 10**9))
    assert (
        "the file system's maximum file size is below the checkpoint's size (about 5.00 GB)" in big
    )
    full = checkpoint_io._explain(
        OSError(errno.ENOSPC, "No space left on device"), target, size(10)
    )
    assert "; no checkpoint was saved yet (no partial file" in full and "intact" not in full
    (folder / "step-00000002.ckpt").write_bytes(b"")
    full = checkpoint_io._explain(
        OSError(errno.ENOSPC, "No space left on device"), target, size(10)
    )
    assert "; the previous checkpoints are intact (no partial file" in full
    other = checkpoint_io._explain(OSError(errno.EIO, "Input/output error"), target)
    assert "Input/output error; the previous checkpoints are intact" in other


def test_the_checkpoints_size_is_measured_or_said_to_be_a_lower_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The size came from the tensors alone (no pickle, zip records or RNG states) and was
    called "about": "file-size limit (ulimit -f: 0.40 MB) is below the checkpoint's size (about
    0.38 MB)". Now it is the newest checkpoint's file where the folder has one, else a lower
    bound said as such, and a bound under the limit is not set against it."""
    import torch

    from nanolab.callbacks import checkpoint_io

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    target = folder / "step-00000004.ckpt"
    state = {"w": torch.zeros(95_000)}  # 0.38 MB of tensors
    first = checkpoint_io.checkpoint_size(state, folder, written=1000)
    assert (first.nbytes, first.at_least) == (380_000, True) and str(first) == "at least 0.38 MB"
    assert checkpoint_io.checkpoint_size(state, folder, written=400_000).nbytes == 400_000
    monkeypatch.setattr(checkpoint_io, "file_size_limit", lambda: 400_000)
    line = checkpoint_io._explain(OSError(errno.EFBIG, "File too large"), target, first)
    assert "file too large: the checkpoint is larger than this process's file-size limit " in line
    assert "(ulimit -f: 0.40 MB); no checkpoint" in line and "0.38" not in line, line
    (folder / "step-00000002.ckpt").write_bytes(b"\0" * 420_251)  # the newest on disk
    measured = checkpoint_io.checkpoint_size(state, folder, written=1000)
    assert (measured.nbytes, measured.at_least) == (420_251, False)
    line = checkpoint_io._explain(OSError(errno.EFBIG, "File too large"), target, measured)
    assert "(ulimit -f: 0.40 MB) is below the checkpoint's size (about 0.42 MB)" in line, line
    full = checkpoint_io._explain(OSError(errno.EDQUOT, "Disk quota exceeded"), target, measured)
    assert "free, checkpoint needs about 0.42 MB)" in full, full


@pytest.mark.skipif(sys.platform == "win32", reason="ulimit -f is a POSIX limit")
def test_fit_stopped_by_a_file_size_limit_exits_74_and_the_rerun_trains(
    tmp_path: Path, char_dataset: Path
) -> None:
    """A checkpoint past ``ulimit -f`` exited 2, which the exit-code table keeps for bad input
    with nothing written, after the run had trained and logged: it is a write refused for room,
    as a full disk is (exit 74), and the same command, once the limit is raised, trains the
    run."""
    import os
    import resource

    from conftest import nanolab_here, tiny_overrides, write_config

    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=2)
    cfg["run"]["eval_every_steps"] = 2
    command = [sys.executable, "-m", "nanolab", "fit", "--config", str(write_config(
        tmp_path / "tiny.yaml", cfg))]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def limit() -> None:  # the checkpoint is ~0.4 MB; the log and the config a few kB
        resource.setrlimit(resource.RLIMIT_FSIZE, (200 * 1024, resource.RLIM_INFINITY))

    res = subprocess.run(command, cwd=tmp_path, env=env, preexec_fn=limit, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert res.returncode == 74, res.stderr[-2000:]
    errors = [line for line in res.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "file too large" in errors[0] and "Traceback" not in res.stderr
    # The rerun (no limit) through the CLI's entry point in this process: the same command.
    rerun = nanolab_here(*command[3:], cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert (tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt").is_file()


def test_a_refused_write_names_the_folder_that_refused_it(tmp_path: Path) -> None:
    """A read-only ``checkpoints/`` in a writable run directory was told to "make the run
    directory writable"; a read-only file system was called "permission denied"."""
    from nanolab.callbacks import checkpoint_io

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    target = folder / "step-00000004.ckpt"
    denied = checkpoint_io._explain(OSError(errno.EACCES, "Permission denied"), target)
    assert denied.endswith(f"; make {folder} writable for this user or choose another run.root")
    assert "run directory" not in denied
    read_only = checkpoint_io._explain(OSError(errno.EROFS, "Read-only file system"), target)
    assert f"{target}: {folder} is on a read-only file system; " in read_only, read_only
    assert "permission denied" not in read_only and read_only.endswith("another run.root")


def test_a_read_only_checkpoints_folder_is_refused_before_training(
    tmp_path: Path, char_dataset: Path
) -> None:
    """It was found at the first save, after steps trained. Said at start-up now, where the
    run directory's own writability is checked: one line naming the folder, exit 2, and the
    run's log untouched. Read-only to root too: chmod does not stop root, the immutable
    attribute does."""
    import os

    from conftest import nanolab_here, tiny_overrides, write_config

    cfg = write_config(tmp_path / "tiny.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    checkpoints = tmp_path / "runs" / "tiny" / "checkpoints"
    checkpoints.mkdir(parents=True)
    checkpoints.chmod(0o555)
    immutable = os.geteuid() == 0
    if immutable and subprocess.run(["chattr", "+i", str(checkpoints)]).returncode:
        pytest.skip("root, and no chattr +i here to make a folder read-only to root")
    try:
        res = nanolab_here("fit", "--config", str(cfg), cwd=tmp_path)
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(checkpoints)], check=True)
        checkpoints.chmod(0o755)
    assert res.returncode == 2, res.stderr[-2000:]
    errors = [line for line in res.stderr.splitlines() if "error:" in line]
    assert errors == [
        f"nanolab fit: error: {checkpoints} (the run's checkpoints) is not writable "
        f"({'Operation not permitted' if immutable else 'Permission denied'}); make "
        f"{checkpoints} writable for this user (the run saves its checkpoints there)"
    ], res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    assert not (checkpoints.parent / "metrics.jsonl").exists()  # nothing trained, nothing logged


def test_a_full_disk_suggests_only_settings_that_keep_fewer_files(tmp_path: Path) -> None:
    """With ``--checkpoint.keep_last 1 --checkpoint.keep_best 0`` the line said "rerun keeping
    fewer of the 2 step checkpoints here: --checkpoint.keep_last 1 --checkpoint.keep_best 0",
    the run's own settings: the second file is the one the spike guard keeps to roll back to.
    The line names that instead, and only settings that would change what is kept."""
    from nanolab.callbacks import checkpoint_io
    from nanolab.callbacks.checkpoint_io import Retention

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for step in (10, 20):
        (folder / f"step-{step:08d}.ckpt").write_bytes(b"\0" * 1000)
    target = folder / "step-00000030.ckpt"

    def line(retention: Retention | None) -> str:
        full = OSError(errno.ENOSPC, "No space left on device")
        return checkpoint_io._explain(full, target, None, retention)

    spiked = line(Retention(keep_last=1, keep_best=0, keep_one_older_than=7))
    assert "--checkpoint.keep_last" not in spiked, spiked
    assert (
        "--spike.enabled false (the spike guard keeps step 10, the newest checkpoint at least 7 "
        "steps older, to roll back to), or --checkpoint.max_disk_gb below 2e-06, deletes" in spiked
    ), spiked
    ageing = line(Retention(keep_last=1, keep_best=0, keep_one_older_than=15))
    assert (
        "--spike.enabled false (the spike guard keeps step 10, the oldest of the last 15 steps, "
        "to roll back to once it is 15 steps old)" in ageing
    ), ageing
    kept_last = line(Retention(keep_last=3, keep_best=1, keep_one_older_than=7))
    assert ": --checkpoint.keep_last 1 --checkpoint.keep_best 0, or --checkpoint.max" in kept_last
    assert "--spike" not in kept_last, kept_last  # keep_last 1 deletes step 10 itself
    capped = line(Retention(keep_last=1, keep_best=0, max_disk_gb=1e-6))
    assert capped.endswith("; free space, then rerun the same command"), capped
    assert "--checkpoint.keep_last 1 --checkpoint.keep_best 0" in line(None)  # settings unknown
