"""A rank that rank 0 launched (Lightning's DDP launcher) dies with rank 0, even by SIGKILL.

Left alone it waited for the dead rank 0 in the process group's rendezvous for 30 minutes and
more, holding its memory (on a GPU, the device's) while the queue, whose SIGKILL of a leftover
job reaches rank 0's pid only, started its next job.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import QUICKSTART, REPO, tiny_overrides, write_config

from nanolab.processes import pid_alive
from nanolab.training.early_signals import LAUNCHER_ENV

#: Seconds a launched rank may outlive its rank 0 (the kernel ends it at once once armed).
GRACE_S = 15.0

#: A launched rank's start-up: arm, say so, then wait as in a rendezvous that never completes.
RANK = (
    "from nanolab.training.early_signals import die_with_launcher\n"
    "die_with_launcher()\n"
    "print('armed', flush=True)\n"
    "import time; time.sleep(600)\n"
)

#: A rank 0 that launches one rank as Lightning's launcher does (its own pid in the
#: environment, ``LOCAL_RANK`` 1), prints the rank's pid, then waits.
LAUNCHER = (
    "import os, subprocess, sys, time\n"
    f"env = {{**os.environ, {LAUNCHER_ENV!r}: str(os.getpid()), 'LOCAL_RANK': '1'}}\n"
    f"rank = subprocess.Popen([sys.executable, '-c', {RANK!r}], env=env)\n"
    "print(rank.pid, flush=True)\n"
    "time.sleep(600)\n"
)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _lines(proc: subprocess.Popen) -> queue.Queue[str]:
    """``proc``'s stdout lines as they come, for reads with a time limit (a rank that never
    says it armed must fail the test, not hang it)."""
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    return lines


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.2)
    return not pid_alive(pid)


def test_a_launched_rank_dies_when_its_rank_zero_is_killed() -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER], env=_env(), stdout=subprocess.PIPE, text=True
    )
    rank = None
    try:
        lines = _lines(launcher)
        rank = int(lines.get(timeout=60))
        assert lines.get(timeout=60).strip() == "armed"
        launcher.kill()
        launcher.wait()
        assert _gone_within(rank, GRACE_S), f"rank {rank} outlived its rank 0"
    finally:
        launcher.kill()
        if rank is not None and pid_alive(rank):
            os.kill(rank, signal.SIGKILL)


def test_a_rank_whose_rank_zero_died_before_it_armed_exits_with_one_line() -> None:
    """Rank 0 died between launching the rank and the rank's start-up (the rank was adopted):
    it exits at once, saying why, instead of waiting in the rendezvous."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs
    env = {**_env(), LAUNCHER_ENV: str(dead.pid), "LOCAL_RANK": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", RANK], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1 and "armed" not in proc.stdout
    assert proc.stderr.strip() == (
        f"nanolab fit: local rank 1: the process that launched it (local rank 0, pid {dead.pid}) "
        "is gone; exiting"
    )


def test_a_process_that_rank_zero_did_not_launch_is_left_alone() -> None:
    """No launcher in the environment, rank 0 itself, or a launcher that still runs but is not
    the parent (``torchrun`` started under a fit): nothing is armed, nothing ends."""
    cases = [
        {"LOCAL_RANK": "1"},
        {LAUNCHER_ENV: "1", "LOCAL_RANK": "0"},
        {LAUNCHER_ENV: "1", "LOCAL_RANK": "1"},  # pid 1 runs, and is not the parent
    ]
    short = RANK.replace("600", "0")
    for extra in cases:
        env = {k: v for k, v in _env().items() if k not in (LAUNCHER_ENV, "LOCAL_RANK")}
        proc = subprocess.run(
            [sys.executable, "-c", short], env={**env, **extra}, capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip
        assert (proc.returncode, proc.stdout, proc.stderr) == (0, "armed\n", ""), extra


@pytest.mark.slow
def test_a_ddp_rank_does_not_outlive_its_rank_zero_killed_during_start_up(
    tmp_path: Path, char_dataset: Path
) -> None:
    """Two CPU processes of a real DDP fit: rank 0 SIGKILLed once its rank 1 runs; rank 1 is
    gone within seconds (it slept in the store's connect, re-parented, for 30 minutes)."""
    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=50)
    cfg["trainer"].update(accelerator="cpu", devices=2, strategy="ddp")
    config = write_config(tmp_path / "ddp.yaml", cfg)
    command = [sys.executable, "-m", "nanolab", "fit", "--config", str(QUICKSTART),
               "--config", str(config)]  # fmt: skip
    rank0 = subprocess.Popen(
        command, cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    rank1 = None
    try:
        deadline = time.monotonic() + 240
        while rank1 is None and rank0.poll() is None and time.monotonic() < deadline:
            rank1 = _child_of(rank0.pid)
            time.sleep(0.1)
        assert rank1 is not None, "rank 0 launched no rank 1"
        time.sleep(2)  # rank 1 in its start-up (imports, the rendezvous)
        rank0.kill()
        rank0.wait()
        assert _gone_within(rank1, GRACE_S), f"rank 1 ({rank1}) outlived its rank 0"
    finally:
        rank0.kill()
        if rank1 is not None and pid_alive(rank1):
            os.kill(rank1, signal.SIGKILL)


def _child_of(parent: int) -> int | None:
    """A process whose parent is ``parent`` (Linux ``/proc``), or None."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[1]) == parent:
            return int(entry.name)
    return None


def test_a_launch_ends_after_the_ranks_it_started_or_ends_them(capfd) -> None:
    """Rank 0 waits at its end for the ranks it launched (they die with it: one still on its
    way out would be cut short), and ends one that is still running after the wait, saying so.
    """
    from nanolab.training import early_signals

    leaving = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"])
    early_signals.end_with_launched_ranks([leaving])
    early_signals.wait_for_launched_ranks(60)
    assert leaving.returncode == 0  # ended by itself, waited for
    hung = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    early_signals.end_with_launched_ranks([hung])
    started = time.monotonic()
    early_signals.wait_for_launched_ranks(1)
    assert hung.returncode == -signal.SIGKILL and time.monotonic() - started < 30
    assert (
        f"a rank this launch started (pid {hung.pid}) was still running 1s after the run "
        "ended; ending it" in capfd.readouterr().err
    )
    early_signals.wait_for_launched_ranks(0)  # nothing left to wait for
