"""Inputs that used to hang a command, or end it in a traceback: each now ends within a bounded
time, with one error line and exit 2 (or the exit a signal asks for).

End to end where the behaviour is the CLI's (a real process, a wall-clock bound); in-process
where a unit says it faster.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, nanolab_here, run_nanolab, tiny_overrides, write_config

from nanolab.model.config import MAX_LAYERS, ConfigError, GPTConfig
from nanolab.training import early_signals
from nanolab.training.early_signals import EXIT_PREEMPTED


def one_error_line(stderr: str, prog: str) -> str:
    """The single ``<prog>: error: ...`` line of ``stderr`` (and nothing that looks like a
    traceback)."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith(f"{prog}: error:")]
    assert len(lines) == 1, stderr
    return lines[0]


# -- 1. an absurd depth is refused by arithmetic, before any block is built -----------------
@pytest.mark.timeout(60)  # a hang guard, not a speed claim: building 10**9 blocks never ends
def test_depth_beyond_the_cap_is_refused_by_the_config() -> None:
    with pytest.raises(ConfigError, match=r"model.gpt.n_layer 1,000,000,000 .*at most 4096"):
        GPTConfig(n_layer=1_000_000_000)
    GPTConfig(n_layer=MAX_LAYERS, n_head=1, n_embd=8)  # the cap itself is a model


def test_host_memory_check_refuses_by_arithmetic_without_building(
    monkeypatch: pytest.MonkeyPatch, char_dataset: Path, tmp_path: Path
) -> None:
    from nanolab.estimator import shapes
    from nanolab.run import autobatch

    def never(*args: object) -> None:
        raise AssertionError("the meta model was built")

    monkeypatch.setattr(shapes, "meta_model", never)
    monkeypatch.setattr(autobatch, "host_memory_available", lambda: 2**30)
    cfg = tiny_overrides(char_dataset, tmp_path, model__gpt__n_layer=4000)
    cfg["model"]["gpt"].update(n_embd=100_000, n_head=1, vocab_size=65)
    with pytest.raises(autobatch.HostMemoryError, match=r"needs at least .* GiB"):
        autobatch.check_fits_on_host(cfg)


@pytest.mark.parametrize("verb", ["fit", "estimate", "queue add"])
def test_a_billion_layers_is_one_line_within_seconds(
    verb: str, char_dataset: Path, tmp_path: Path
) -> None:
    cfg = tiny_overrides(char_dataset, tmp_path / "runs", model__gpt__n_layer=1_000_000_000)
    config = write_config(tmp_path / "deep.yaml", cfg)
    args = {
        "fit": ["fit", "--config", str(config)],
        "estimate": ["estimate", "--config", str(config)],
        "queue add": ["queue", "add", "--db", str(tmp_path / "q.db"), str(config)],
    }[verb]
    start = time.monotonic()
    # fit and queue add import Lightning before they read the config (~8 s a process on 2
    # cores): they refuse in this process; estimate, which does not, in its own.
    run = run_nanolab if verb == "estimate" else nanolab_here
    out = run(*args, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert "model.gpt.n_layer 1,000,000,000" in one_error_line(out.stderr, f"nanolab {verb}")
    assert time.monotonic() - start < 60


# -- 2. a YAML alias bomb is refused before any reader expands it -----------------------------
def _alias_bomb(path: Path, levels: int = 9) -> Path:
    """The "billion laughs": each level nine aliases of the one before (9**9 strings)."""
    lines = ["a0: &a0 [" + ", ".join(["lol"] * 9) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels + 1)]
    path.write_text("\n".join([*lines, "trainer: {max_steps: 2}", ""]))
    return path


@pytest.mark.timeout(60)  # a hang guard: expanding 9**9 strings takes minutes and gigabytes
def test_alias_expansion_is_counted_without_expanding(tmp_path: Path) -> None:
    from nanolab.errors import RunConfigError
    from nanolab.training.resolve import check_alias_expansion, load_yaml

    text = _alias_bomb(tmp_path / "b.yaml").read_text()
    with pytest.raises(RunConfigError, match=r"^bomb.yaml: its anchors and aliases expand"):
        load_yaml(text, "bomb.yaml")
    check_alias_expansion("base: &b {lr: 1}\nx: *b\ny: *b\n")  # ordinary aliases are fine
    with pytest.raises(RunConfigError, match="aliases expand"):
        check_alias_expansion("a: &a [1, *a]\n")  # a list that contains itself


@pytest.mark.parametrize("verb", ["fit", "estimate", "queue add"])
def test_billion_laughs_is_one_line_naming_the_file(
    verb: str, char_dataset: Path, tmp_path: Path
) -> None:
    bomb = _alias_bomb(tmp_path / "laughs.yaml")
    base = write_config(tmp_path / "base.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    args = {
        "fit": ["fit", "--config", str(base), "--config", str(bomb)],
        "estimate": ["estimate", "--config", str(base), "--config", str(bomb)],
        "queue add": ["queue", "add", "--db", str(tmp_path / "q.db"), str(bomb)],
    }[verb]
    start = time.monotonic()
    # queue add imports Lightning first (~8 s a process on 2 cores): it refuses in this process
    run = nanolab_here if verb == "queue add" else run_nanolab
    out = run(*args, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    line = one_error_line(out.stderr, f"nanolab {verb}")
    assert "laughs.yaml: its anchors and aliases expand" in line
    assert line.count("laughs.yaml") == 1
    assert time.monotonic() - start < 60


# -- 3. a signal before the first step ends the process within seconds -------------------------
def _start_fit(tmp_path: Path, cfg: dict, *extra: str) -> subprocess.Popen:
    config = write_config(tmp_path / "fit.yaml", cfg)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "nanolab", "fit", "--config", str(config), *extra],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_file(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def _wait_for_the_handlers(proc: subprocess.Popen, timeout: float = 60) -> None:
    """Until the process catches SIGTERM (nanolab's start-up handlers are in; Python's own
    SIGINT handler is there from the start), read from ``/proc/PID/status``."""
    status = Path(f"/proc/{proc.pid}/status")
    if not status.exists():
        return  # not Linux: the delays alone
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            lines = status.read_text().splitlines()
        except OSError:  # it has just ended: the test's asserts say how
            return
        caught = [ln for ln in lines if ln.startswith("SigCgt:")]
        if caught and int(caught[0].split()[1], 16) >> (signal.SIGTERM - 1) & 1:
            return
        time.sleep(0.005)


@pytest.mark.parametrize(
    ("sig", "after_s"),
    [(signal.SIGINT, 0.5), (signal.SIGTERM, 0.3), (signal.SIGTERM, 0.8), (signal.SIGTERM, 1.5)],
)
def test_a_signal_while_nothing_is_written_ends_the_run_at_once(
    sig: signal.Signals, after_s: float, char_dataset: Path, tmp_path: Path
) -> None:
    """Whichever import the signal lands in (Lightning, torchmetrics, scipy, numpy): exit 75 and
    one line, never a half-imported module's traceback."""
    proc = _start_fit(tmp_path, tiny_overrides(char_dataset, tmp_path / "runs"))
    _wait_for_the_handlers(proc)  # on a loaded machine 0.3 s can end before nanolab starts
    time.sleep(after_s)  # importing Lightning: seconds from any safe point
    proc.send_signal(sig)
    sent = time.monotonic()
    code = proc.wait(timeout=60)
    err = proc.stderr.read()
    # Exit 75 with the "before the first step" line is the handler's path (the watchdog's is
    # death by the signal); the bound only says it did not wait for anything, with room for a
    # loaded machine (5.9 s seen at load 3 on 2 cores).
    assert time.monotonic() - sent < 30, err
    assert code == EXIT_PREEMPTED, err
    assert "before the first step" in err.strip().splitlines()[-1] and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow  # waits out the 5 s grace, ~11 s each
@pytest.mark.parametrize("resumable", [False, True], ids=["fresh", "with-checkpoint"])
def test_a_start_up_stuck_after_it_began_writing_ends_within_the_grace(
    resumable: bool, char_dataset: Path, tmp_path: Path
) -> None:
    """A fork's callback that never finishes building: no safe point comes, the watchdog ends
    the process: exit 75 with a checkpoint to resume from, else death by the signal."""
    marker = tmp_path / "hanging"
    cfg = tiny_overrides(char_dataset, tmp_path / "runs")
    cfg["trainer"]["callbacks"] = [
        {"class_path": "hang_probes.HangsWhenBuilt", "init_args": {"marker": str(marker)}}
    ]
    if resumable:
        (tmp_path / "runs" / "tiny" / "checkpoints").mkdir(parents=True)
        (tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt").write_bytes(b"weights")
    proc = _start_fit(tmp_path, cfg)
    _wait_for_file(marker, proc)
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    code = proc.wait(timeout=60)
    err = proc.stderr.read()
    assert time.monotonic() - sent < early_signals.START_GRACE_S + 5, err
    last = err.strip().splitlines()[-1]
    if resumable:
        assert code == EXIT_PREEMPTED, err
        assert "rerun the same command to resume" in last
    else:
        assert code == -signal.SIGTERM, err
        assert "nothing to resume; exiting by SIGTERM" in last
    assert "Traceback" not in err


# -- 4. signal handlers belong to a run, for its duration only --------------------------------
HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def _handlers() -> dict[signal.Signals, object]:
    return {sig: signal.getsignal(sig) for sig in HANDLED}


def test_importing_nanolab_and_building_its_objects_installs_no_handler() -> None:
    code = (
        "import importlib, pkgutil, signal, sys\n"
        "sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)\n"
        "before = [signal.getsignal(s) for s in sigs]\n"
        "import nanolab\n"
        "for m in pkgutil.walk_packages(nanolab.__path__, 'nanolab.'):\n"
        "    if m.name != 'nanolab.__main__':\n"
        "        importlib.import_module(m.name)\n"
        "from nanolab.callbacks.preemption import PreemptionHandler\n"
        "from nanolab.run.parse import run_callbacks\n"
        "[cls() for cls in run_callbacks().values()]\n"
        "PreemptionHandler()\n"
        "after = [signal.getsignal(s) for s in sigs]\n"
        "sys.exit(0 if before == after else f'{before} -> {after}')\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.parametrize("outcome", ["completed", "refused"])
def test_an_in_process_fit_puts_back_the_handlers_it_found(
    outcome: str, char_dataset: Path, tmp_path: Path
) -> None:
    from nanolab.cli import main

    def mine(signum: int, frame: object) -> None:  # a test runner's own handler
        raise KeyboardInterrupt

    previous = _handlers()
    try:
        signal.signal(signal.SIGINT, mine)
        before = _handlers()
        cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=1)
        config = write_config(tmp_path / "fit.yaml", cfg)
        extra = ["--model.gpt.n_layer", "0"] if outcome == "refused" else []
        code = main(["fit", "--config", str(config), *extra])
        assert code == (2 if outcome == "refused" else 0)
        assert _handlers() == before
        assert early_signals.received() is None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# -- 5. tracebacks that are one line now ------------------------------------------------------
def test_an_empty_dataset_dir_is_refused_by_fit_and_by_queue_add(
    char_dataset: Path, tmp_path: Path
) -> None:
    cfg = tiny_overrides(char_dataset, tmp_path / "runs")
    cfg["data"]["source"] = ["bundled:shakespeare"]  # preparing into '' was the traceback
    config = write_config(tmp_path / "fit.yaml", cfg)
    fit = nanolab_here("fit", "--config", str(config), "--data.dataset_dir", "", cwd=tmp_path)
    add = run_nanolab(
        "queue", "add", "--db", str(tmp_path / "q.db"), str(config), "--set", "data.dataset_dir=",
        cwd=tmp_path,
    )  # fmt: skip
    for out, prog in ((fit, "nanolab fit"), (add, "nanolab queue add")):
        assert out.returncode == 2, out.stderr
        assert "data.dataset_dir is empty" in one_error_line(out.stderr, prog)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("case", ["raises", "lambda-arguments"])
def test_a_callback_of_the_config_that_cannot_work_is_one_line(
    case: str, char_dataset: Path, tmp_path: Path
) -> None:
    cfg = tiny_overrides(char_dataset, tmp_path / "runs")
    cfg["trainer"]["callbacks"] = [
        {"class_path": "hang_probes.FailsWhenBuilt"}
        if case == "raises"
        else {
            "class_path": "lightning.pytorch.callbacks.LambdaCallback",
            "init_args": {"on_train_start": "os.getcwd"},  # takes no (trainer, pl_module)
        }
    ]
    config = write_config(tmp_path / "fit.yaml", cfg)
    out = nanolab_here("fit", "--config", str(config), cwd=tmp_path)  # hang_probes: tests/
    assert out.returncode == 2, out.stderr[-3000:]
    line = one_error_line(out.stderr, "nanolab fit")
    if case == "raises":
        assert "hang_probes.FailsWhenBuilt could not be built (RuntimeError: this callback" in line
    else:
        assert "LambdaCallback on_train_start=getcwd cannot be called with" in line


def test_a_clipping_norm_that_is_not_a_finite_number_says_so() -> None:
    from nanolab.run.parse import FitParseError, parse_fit_config
    from nanolab.training.resolve import RunConfigError, check_gradient_clip

    rule = r"trainer.gradient_clip_val: .* must be a finite number >= 0"
    with pytest.raises(FitParseError, match=rule):  # the parser reads "nan" as a string
        parse_fit_config(["--trainer.gradient_clip_val=nan"])
    for bad in (float("nan"), float("inf"), -1.0):  # what YAML's .nan / .inf / -1 give
        with pytest.raises(RunConfigError, match=rule):
            check_gradient_clip(bad)
    check_gradient_clip(None)
    check_gradient_clip(0)


def test_union_reports_say_what_the_value_must_be() -> None:
    from nanolab.run.parse import union_problem

    report = (
        'Parser key "run.micro_batch_size": Does not validate against any of the Union subtypes '
        "Subtypes: [<class 'int'>, typing.Literal['auto'], <class 'NoneType'>] Errors: - "
        "Expected a <class 'int'> - Expected a typing.Literal['auto'] - Expected a <class "
        "'NoneType'> Given value type: <class 'str'> Given value: x"
    )
    assert union_problem(report) == (
        "run.micro_batch_size: 'x' is not valid; expected int or 'auto' (or null)"
    )


def test_a_command_line_value_of_the_wrong_type_says_what_it_must_be() -> None:
    """``--trainer.max_steps null`` printed the parser's "Expected a <class 'int'>. Got value:
    None"; it gets the message ``max_steps: null`` in a file gets, with the fix."""
    from nanolab.run.parse import FitParseError, parse_fit_config

    with pytest.raises(
        FitParseError, match=r"trainer.max_steps must be a positive number .* got null"
    ):
        parse_fit_config(["--trainer.max_steps", "null"])
    with pytest.raises(
        FitParseError, match=r"model.gpt.n_layer: 'two' is not valid; expected int$"
    ):
        parse_fit_config(["--model.gpt.n_layer", "two"])


def _lm_eval_checkpoint(folder: Path) -> Path:
    """A 2-layer checkpoint as ``fit`` writes one (weights, model config, tokenizer spec)."""
    from dataclasses import asdict

    import torch

    from nanolab.data.tokenizers import CharTokenizer
    from nanolab.model import GPT

    tok = CharTokenizer(list("abc "))
    cfg = GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=8, vocab_size=tok.vocab_size)
    path = folder / "tiny.ckpt"
    state = {f"model.{k}": v for k, v in GPT(cfg).state_dict().items()}
    nanolab = {"gpt": asdict(cfg), "tokenizer": tok.to_meta()}
    torch.save({"state_dict": state, "global_step": 0, "nanolab": nanolab}, path)
    return path


@pytest.mark.slow  # imports lm-eval, ~10 s each
@pytest.mark.parametrize("case", ["unknown", "offline"])
def test_lm_eval_task_problems_are_one_line_naming_the_task(case: str, tmp_path: Path) -> None:
    pytest.importorskip("lm_eval")
    task = "nanolab_no_such_task" if case == "unknown" else "lambada_openai"
    out = run_nanolab(
        "lm-eval", "run", "--model", "nanolab", "--device", "cpu", "--limit", "1",
        "--model_args", f"checkpoint={_lm_eval_checkpoint(tmp_path)}", "--tasks", task,
        cwd=tmp_path, env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-3000:]
    line = one_error_line(out.stderr, "nanolab lm-eval")
    assert f"--tasks {task}:" in line
    assert ("no such lm-eval task" if case == "unknown" else "could not be fetched") in line


# -- 8. a run that ends on a non-finite loss diverged, however short ----------------------------
def test_a_run_shorter_than_the_patience_that_ends_nan_is_diverged(
    char_dataset: Path, tmp_path: Path
) -> None:
    import json

    from nanolab.callbacks.divergence import EXIT_DIVERGED

    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=2)
    cfg["model"]["optimizer"] = {"lr": 1e30}
    config = write_config(tmp_path / "fit.yaml", cfg)
    out = nanolab_here("fit", "--config", str(config), cwd=tmp_path)  # exit 3 in a process:
    assert out.returncode == EXIT_DIVERGED, out.stderr[-3000:]  # test_adversarial's divergence
    assert "nanolab fit: diverged: " in out.stderr and "at the end of the run" in out.stderr
    records = (tmp_path / "runs" / "tiny" / "metrics.jsonl").read_text().splitlines()
    end = json.loads(records[-1])
    assert end["event"] == "end" and end["reason"] == "diverged", end
    assert end["diverged_step"] is not None


# -- 9. prepare names what a source is instead of a file, the same way everywhere ------------
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX")
def test_prepare_names_fifos_and_broken_links_wherever_they_are(tmp_path: Path) -> None:
    from nanolab.data.sources import SourceError, resolve_sources

    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("to be or not to be\n")
    os.mkfifo(folder / "pipe.txt")
    (folder / "gone.txt").symlink_to(tmp_path / "nowhere.txt")
    (folder / "self.txt").symlink_to(folder / "self.txt")

    notes = resolve_sources([str(folder)]).skipped
    assert f"{folder}/pipe.txt: a FIFO (named pipe), skipped" in notes
    assert f"{folder}/gone.txt: a broken symlink, skipped" in notes
    assert f"{folder}/self.txt: a symlink loop, skipped" in notes
    globbed = resolve_sources([str(folder / "*.txt")]).skipped
    assert f"{folder}/gone.txt: a broken symlink, skipped" in globbed
    for name, what in (("pipe.txt", "a FIFO (named pipe)"), ("gone.txt", "a broken symlink")):
        with pytest.raises(SourceError, match=rf"is {re.escape(what)}, not a file nanolab"):
            resolve_sources([str(folder / name)])

    start = time.monotonic()  # reading the FIFO would block forever: it is never opened
    out = run_nanolab("prepare", str(folder / "pipe.txt"), "-o", str(tmp_path / "d"), cwd=tmp_path)
    assert out.returncode == 2 and time.monotonic() - start < 30
    line = one_error_line(out.stderr, "nanolab prepare")
    assert "pipe.txt' is a FIFO (named pipe), not a file nanolab can read" in line


# -- 7. prepare's workers die with it; --workers is capped at the usable cores ----------------
def _children(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (from /proc)."""
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for a reaper)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_sigkill_of_prepare_takes_its_workers_and_resource_tracker_along(tmp_path: Path) -> None:
    import random

    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    lines = (" ".join(rng.choices(words, k=12)) for _ in range(300_000))
    (tmp_path / "big.txt").write_text("\n".join(lines))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "nanolab", "prepare", str(tmp_path / "big.txt"), "-q",
         "-o", str(tmp_path / "out"), "--workers", "2"],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    kids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(kids) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # two workers and the resource tracker
            kids = _children(proc.pid)
        assert len(kids) >= 3, f"prepare ended or never started its workers ({kids})"
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 15
        while any(_alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [k for k in kids if _alive(k)], "orphans outlived prepare"
    finally:
        for k in kids:  # only processes this test started
            if _alive(k):
                os.kill(k, signal.SIGKILL)


def test_more_workers_than_cores_is_capped_with_a_note(tmp_path: Path) -> None:
    from nanolab.data.prepare import default_workers

    (tmp_path / "a.txt").write_text("to be or not to be, that is the question\n" * 50)
    out = run_nanolab(
        "prepare", str(tmp_path / "a.txt"), "-o", str(tmp_path / "d"), "--workers", "4096",
        cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    usable = default_workers()
    note = f"nanolab prepare: --workers 4096 is more than the {usable} usable core"
    assert note in out.stderr and f"; using {usable}" in out.stderr


# -- 6. an unknown key gets the nearest known one, and is refused before Lightning loads ---------
def test_unknown_keys_get_the_nearest_known_key() -> None:
    from nanolab.errors import RunConfigError
    from nanolab.run.keys import check_keys

    known = frozenset(
        ["model.gpt.n_layer", "model.gpt.n_head", "trainer.max_steps", "trainer.callbacks",
         "log.every_n_steps", "model.class_path"]
    )  # fmt: skip
    for argv, message in (
        (["--model.gpt.n_layers", "3"], "unknown setting --model.gpt.n_layers; did you mean "
         "--model.gpt.n_layer?"),
        (["--trainr.max_steps=3"], "did you mean --trainer.max_steps?"),
        (["--trainer.max_step", "3"], "did you mean --trainer.max_steps?"),  # no abbreviations
        (["--log.evry", "3"], "did you mean --log.every_n_steps?"),
        (["--zzz.qqq", "1"], "unknown setting --zzz.qqq; `nanolab fit --help` lists them"),
    ):  # fmt: skip
        with pytest.raises(RunConfigError, match=re.escape(message)):
            check_keys(argv, known)
    check_keys(["--model.init_args.gpt.n_layer", "2", "--trainer.callbacks+=X"], known)
    check_keys(["--trainer.callbacks.init_args.x", "1"], known)  # inside a free-form setting
    check_keys(["--model", "my.Model", "--model.anything", "1"], known)  # another class's keys


def _fit_reporting_imports(
    base: Path, args: list[str], cwd: Path, env: dict[str, str]
) -> subprocess.CompletedProcess:
    """``nanolab fit`` in a process that prints, at exit, which heavy modules it imported."""
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('imported:', *sorted(m for m in ('torch', 'lightning')"
        " if m in sys.modules)))\n"
        "from nanolab.cli import main\n"
        "sys.exit(main())\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, "fit", "--config", str(base), *args],
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("where", ["command line", "config file"])
def test_an_unknown_key_is_refused_with_a_suggestion_without_importing_torch(
    where: str, char_dataset: Path, tmp_path: Path
) -> None:
    base = write_config(tmp_path / "base.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    typo = write_config(tmp_path / "typo.yaml", {"model": {"gpt": {"n_layers": 3}}})
    args = ["--model.gpt.n_layers", "3"] if where == "command line" else ["--config", str(typo)]
    env = {"NANOLAB_ESTIMATOR_CACHE": str(tmp_path / "cache")}  # a cold cache: the first run
    lines, heavy = [], []
    for _ in range(2):
        out = _fit_reporting_imports(base, args, tmp_path, env)
        assert out.returncode == 2, out.stderr
        lines.append(one_error_line(out.stderr, "nanolab fit"))
        heavy.append(out.stdout.split("imported:")[-1].split())
    assert lines[0] == lines[1]  # the parser's answer and the early check's are the same
    if where == "command line":
        assert lines[0].endswith("unknown setting --model.gpt.n_layers; did you mean "
                                 "--model.gpt.n_layer?")  # fmt: skip
    else:
        assert lines[0].endswith(f"config file {typo}: unknown setting model.gpt.n_layers; did "
                                 "you mean model.gpt.n_layer?")  # fmt: skip
    # What makes it answer at once (~0.15 s, where importing Lightning takes seconds): the
    # second run, with the key list cached by the first, imports neither torch nor Lightning.
    assert heavy[1] == [], heavy
    assert not (tmp_path / "runs").exists()


def test_an_option_without_its_group_or_a_verb_mistyped_gets_the_right_name(capsys) -> None:
    """``--max_steps 50`` was "unrecognized arguments" and ``nanolab train`` an unknown verb,
    with nothing to say what was meant."""
    from nanolab.cli import main
    from nanolab.run.parse import FitParseError, parse_fit_config

    with pytest.raises(
        FitParseError, match=r"unknown option --max_steps; did you mean --trainer\.max_steps\?"
    ):
        parse_fit_config(["--max_steps", "50"])
    with pytest.raises(FitParseError, match=r"did you mean --model\.optimizer\.lr\?"):
        parse_fit_config(["--lr=0.1"])
    assert main(["train"]) == 2
    assert "unknown verb 'train'; did you mean `nanolab fit`?" in capsys.readouterr().err


MODULE = "nanolab.training.module.GPTLightningModule"


@pytest.mark.parametrize(
    "choose", [["--model", MODULE], [f"--model={MODULE}"]], ids=["separate", "joined"]
)
def test_a_mistyped_key_of_a_class_chosen_on_the_command_line_is_named(
    choose: list[str], char_dataset: Path, tmp_path: Path, capsys
) -> None:
    """``--model X --model.gpt.n_layers 3`` (forking.md's pattern) was "unknown option --model;
    did you mean --progress.mode?": ``--model`` itself was taken for an option without its
    group. Now fit, parse_fit_config and ``queue add`` name the mistyped key."""
    from nanolab.cli import main
    from nanolab.run.parse import FitParseError, parse_fit_config

    wanted = "unknown setting --model.gpt.n_layers; did you mean --model.gpt.n_layer?"
    args = [*choose, "--model.gpt.n_layers", "3"]
    with pytest.raises(FitParseError) as refused:
        parse_fit_config(args)
    assert str(refused.value) == wanted
    base = write_config(tmp_path / "base.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    assert main(["fit", "--config", str(base), *args]) == 2
    assert capsys.readouterr().err.strip() == f"nanolab fit: error: {wanted}"
    db = tmp_path / "q.db"
    assert main(["queue", "add", str(base), *args, "--db", str(db)]) == 2
    assert capsys.readouterr().err.strip().endswith(wanted)
    assert not (tmp_path / "runs").exists()


# -- 10. an eval suite, its task file or a bundle's file that is a FIFO is named, not read -----
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX")
@pytest.mark.timeout(60)  # a hang guard: reading a FIFO with no writer never returns
def test_an_eval_suite_or_task_file_that_is_a_fifo_is_refused(tmp_path: Path) -> None:
    from nanolab.downstream.tasks import TaskFileError, load_suite

    os.mkfifo(tmp_path / "suite.yaml")
    with pytest.raises(TaskFileError, match=r"^suite .*suite.yaml is a FIFO \(named pipe\), not"):
        load_suite(tmp_path / "suite.yaml")
    os.mkfifo(tmp_path / "t.jsonl")
    (tmp_path / "s.yaml").write_text("- {file: t.jsonl, kind: multiple_choice}\n")
    with pytest.raises(TaskFileError, match=r"^task file .*t.jsonl is a FIFO \(named pipe\)"):
        load_suite(tmp_path / "s.yaml")
    bundle = tmp_path / "bundle"
    (bundle / "eval_data").mkdir(parents=True)
    os.mkfifo(bundle / "core.yaml")
    (bundle / "eval_meta_data.csv").write_text("Eval Task,Random baseline\n")
    with pytest.raises(TaskFileError, match=r"core.yaml is a FIFO \(named pipe\), not a file"):
        load_suite(bundle)
