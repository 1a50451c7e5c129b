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
    early_signals.end_with_launched_ranks(_Launcher(leaving))
    early_signals.wait_for_launched_ranks(60)
    assert leaving.returncode == 0  # ended by itself, waited for
    hung = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    early_signals.end_with_launched_ranks(_Launcher(hung))
    started = time.monotonic()
    early_signals.wait_for_launched_ranks(1)
    assert hung.returncode == -signal.SIGKILL and time.monotonic() - started < 30
    assert (
        f"a rank this launch started (pid {hung.pid}) was still running 1s after the run "
        "ended; ending it" in capfd.readouterr().err
    )
    early_signals.wait_for_launched_ranks(0)  # nothing left to wait for


class _Launcher:
    """Lightning's DDP launcher as rank 0 sees it: ``procs`` is rebound when it starts ranks."""

    def __init__(self, *procs: subprocess.Popen) -> None:
        self.procs: list[subprocess.Popen] = list(procs)


def test_a_launch_waits_for_the_ranks_its_launcher_started_after_registering_it() -> None:
    """The launcher is registered before the fit and starts its ranks into a NEW list
    (Lightning's ``_call_children_scripts`` rebinds ``procs``): the end still waits for them."""
    from nanolab.training import early_signals

    launcher = _Launcher()
    early_signals.end_with_launched_ranks(launcher)
    launcher.procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"])]
    early_signals.wait_for_launched_ranks(60)
    assert launcher.procs[0].returncode == 0  # waited for: it ended by itself


def test_a_launch_that_failed_alone_ends_its_ranks_after_a_short_grace() -> None:
    """Rank 0 ending on its own error (exit 74, a full disk) leaves its ranks in a collective
    that never completes: they are ended within seconds, not after the whole wait."""
    from nanolab.training import early_signals

    launcher = _Launcher()
    with early_signals.held_during_startup() as launch:
        early_signals.end_with_launched_ranks(launcher)
        launcher.procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])]
        launch.exit_code = 74
        started = time.monotonic()
    assert launcher.procs[0].returncode == -signal.SIGKILL
    assert time.monotonic() - started < early_signals.RANKS_END_WAIT_S / 2
    assert early_signals.ranks_wait_s(0) == early_signals.RANKS_END_WAIT_S
    assert early_signals.ranks_wait_s(75) == early_signals.RANKS_END_WAIT_S


def test_a_ctrl_c_while_waiting_for_the_ranks_ends_them_without_a_traceback(capfd) -> None:
    from nanolab.training import early_signals

    hung = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    launcher = _Launcher(hung)
    early_signals.end_with_launched_ranks(launcher)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        early_signals.wait_for_launched_ranks(60)  # no KeyboardInterrupt out of it
    finally:
        signal.signal(signal.SIGINT, previous)
    assert hung.returncode == -signal.SIGKILL
    assert (
        "interrupted while waiting for the ranks this launch started; ending them "
        f"(pid {hung.pid})" in capfd.readouterr().err
    )


#: Runs its arguments (rank 0) as a child subreaper: every rank, re-parented to it when rank 0
#: ends, is reaped here, so its OWN exit status is seen. Sends ``argv[1]`` to rank 0 only once
#: rank 0 printed its banner's ``steps`` line (stdout and stderr both read) (``none``: no signal); prints one JSON line.
SUBREAPER = """
import ctypes, json, os, signal, subprocess, sys, time
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
rank0 = subprocess.Popen(sys.argv[2:], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
ended = {}
for line in rank0.stdout:
    sys.stderr.write(line)
    if "completed at step" in line:
        ended["said_done"] = [0, time.monotonic()]
    if line.lstrip().startswith("steps") and sys.argv[1] != "none":
        time.sleep(1.0)
        rank0.send_signal(getattr(signal, sys.argv[1]))
        break
threading = __import__("threading")
threading.Thread(target=lambda: [sys.stderr.write(x) for x in rank0.stdout], daemon=True).start()
while True:
    try:
        pid, status = os.wait()
    except ChildProcessError:
        break
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    ended["rank0" if pid == rank0.pid else str(pid)] = [code, time.monotonic()]
print(json.dumps(ended), flush=True)
"""


#: A rank that rank 0 launched lingers 3 s on its way out (its last lines, a slow exit).
SLOW_EXIT = """
import atexit, os, time
if os.environ.get("LOCAL_RANK", "0") != "0":
    atexit.register(time.sleep, 3)
"""


def _ddp_ends(tmp_path: Path, char_dataset: Path, sig: str, max_steps: int) -> dict:
    import json

    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=max_steps)
    cfg["trainer"].update(accelerator="cpu", devices=2, strategy="ddp")
    config = write_config(tmp_path / "ddp.yaml", cfg)
    command = [sys.executable, "-c", SUBREAPER, sig, sys.executable, "-m", "nanolab", "fit",
               "--config", str(QUICKSTART), "--config", str(config)]  # fmt: skip
    hooks = tmp_path / "hooks"  # rank 1 takes 3 s to exit: rank 0 must wait for it
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SLOW_EXIT)
    env = {**_env(), "PYTHONPATH": f"{hooks}{os.pathsep}{REPO}"}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)  # fmt: skip
    ended = json.loads(done.stdout.strip().splitlines()[-1])
    assert "rank0" in ended and "was still running" not in done.stderr, done.stderr[-3000:]
    return ended


def _rank1(ended: dict, code: int) -> list:
    """Rank 1's own end: seen here if it outlived rank 0 (re-parented to the subreaper), else
    rank 0 reaped it after it ended by itself (rank 0 ends one only with a line, checked above).
    """
    others = [value for key, value in ended.items() if key not in ("rank0", "said_done")]
    return others[0] if others else [code, ended["rank0"][1]]


@pytest.mark.slow
def test_a_ddp_rank_ends_on_its_own_after_a_sigterm_to_rank_zero_only(
    tmp_path: Path, char_dataset: Path
) -> None:
    """SIGTERM to rank 0 alone: the ranks agree to stop and each exits 75 by itself; rank 0
    waits for its rank 1 instead of returning while it still exits (which SIGKILLed it)."""
    ended = _ddp_ends(tmp_path, char_dataset, "SIGTERM", 20_000)
    rank1 = _rank1(ended, 75)
    assert ended["rank0"][0] == 75 and rank1[0] == 75, ended  # not SIGKILLed on its way out


@pytest.mark.slow
def test_a_clean_ddp_run_ends_with_its_ranks_without_a_wait(
    tmp_path: Path, char_dataset: Path
) -> None:
    ended = _ddp_ends(tmp_path, char_dataset, "none", 6)
    rank1 = _rank1(ended, 0)
    assert ended["rank0"][0] == 0 and rank1[0] == 0, ended
    # From its last line rank 0 waits only for rank 1's own 3 s exit, not the 30 s allowed.
    assert ended["rank0"][1] - ended["said_done"][1] < 12, ended


@pytest.mark.parametrize("verb", ["validate", "test"])
def test_an_evaluation_rank_whose_rank_zero_is_gone_exits_with_one_line(
    tmp_path: Path, verb: str
) -> None:
    """``validate`` and ``test`` launch ranks as ``fit`` does: a rank of theirs ties itself to
    its rank 0 the same way (it used to run on without it, waiting in the rendezvous)."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    env = {**_env(), LAUNCHER_ENV: str(dead.pid), "LOCAL_RANK": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "nanolab", verb, "--config", str(QUICKSTART)], cwd=tmp_path,
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert (proc.returncode, proc.stderr.strip()) == (
        1,
        f"nanolab {verb}: local rank 1: the process that launched it (local rank 0, pid "
        f"{dead.pid}) is gone; exiting",
    )


@pytest.mark.slow  # a real 2-process CPU DDP validate (~30 s on 2 busy cores)
def test_a_validate_rank_does_not_outlive_its_rank_zero(tmp_path: Path, char_dataset: Path) -> None:
    """SIGKILL of rank 0 of a 2-process validate once its rank 1 is in the process group: rank 1
    is gone within seconds (it waited in its first collective, holding its memory)."""
    cfg = tiny_overrides(char_dataset, tmp_path / "runs")
    cfg["trainer"].update(accelerator="cpu", devices=2, strategy="ddp")
    config = write_config(tmp_path / "ddp.yaml", cfg)
    command = [sys.executable, "-m", "nanolab", "validate", "--config", str(config),
               "--ckpt_path", "none"]  # fmt: skip
    rank0 = subprocess.Popen(
        command, cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    rank1 = None
    try:
        lines = _lines_of(rank0.stderr)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:  # rank 1 said it joins: past its start-up's arming
            if "GLOBAL_RANK: 1" in lines.get(timeout=240):
                break
        rank1 = _child_of(rank0.pid)
        assert rank1 is not None, "rank 0 launched no rank 1"
        rank0.kill()
        rank0.wait()
        assert _gone_within(rank1, GRACE_S), f"rank 1 ({rank1}) outlived its rank 0"
    finally:
        rank0.kill()
        if rank1 is not None and pid_alive(rank1):
            os.kill(rank1, signal.SIGKILL)


def _lines_of(stream) -> queue.Queue[str]:
    """``stream``'s lines as they come, for reads with a time limit."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in stream], daemon=True).start()
    return lines
