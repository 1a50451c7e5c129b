"""Links and names that would point one run's writes at another run's files.

Each test swaps a path under a live run (a callback in the run's own config does it at a fixed
step, so the swap lands mid-run every time) or names an existing run from the queue, and checks
the contract of docs/guarantees.md ("Links and names"): the other run's files hash the same
before and after, and the command ends in one line (exit 2, no traceback) or says what it does.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import nanolab_here, tiny_overrides, write_config

from nanolab.runlog import read_records

EXIT_USAGE = 2

#: A callback the run under test loads from its config: at ``at_step`` it does what a hostile
#: shell would (``mv`` the run's ``name`` to ``<name>.moved``, or ``rm`` it, then ``ln -s``
#: ``target`` in its place; or ``rm -rf`` it, ``how="rmtree"``).
SWAPPER = """
import os, shutil
from lightning.pytorch import Callback

class Swap(Callback):
    def __init__(self, name: str, target: str, at_step: int = 3, how: str = "move") -> None:
        self.name, self.target, self.at_step, self.how, self.done = name, target, at_step, how, False

    def on_train_batch_end(self, trainer, *args):
        if self.done or trainer.global_step < self.at_step:
            return
        self.done = True
        path = os.path.join(trainer.default_root_dir, self.name)
        if self.how == "rmtree":
            shutil.rmtree(path)
            return
        if self.how == "move":
            os.rename(path, path + ".moved")
        else:
            os.unlink(path)
        os.symlink(self.target, path)
"""


def digests(root: Path) -> dict[str, str]:
    """sha256 of every regular file under ``root`` (links are not followed)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def last_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


@pytest.fixture(scope="module")
def victim(tmp_path_factory, char_dataset) -> Path:
    """A finished tiny run ``b`` (checkpoints at steps 4 and 6, ``last.ckpt``), trained once,
    in this process."""
    root = tmp_path_factory.mktemp("victim")
    cfg = tiny_overrides(char_dataset, root / "runs", run__name="b")
    cfg["checkpoint"] = {"every_n_steps": 2, "keep_last": 2}
    res = nanolab_here("fit", "--config", str(write_config(root / "b.yaml", cfg)), cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    return root / "runs" / "b"


def _fit_with_swap(
    tmp_path: Path, char_dataset: Path, victim: Path, **swap: object
) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """Run ``a`` next to a copy of ``victim`` (as ``b``) with the swap; (result, a, b)."""
    runs = tmp_path / "runs"
    shutil.copytree(victim, runs / "b")
    (tmp_path / "swapper.py").write_text(SWAPPER)
    cfg = tiny_overrides(char_dataset, runs, run__name="a", trainer__max_steps=8)
    cfg["checkpoint"] = {"every_n_steps": 1, "keep_last": 1, "keep_best": 0}
    cfg["trainer"]["callbacks"] = [{"class_path": "swapper.Swap", "init_args": swap}]
    config = write_config(tmp_path / "a.yaml", cfg)
    # In this process (a process pays ~8 s of imports): the swapper importable from here.
    sys.path.insert(0, str(tmp_path))
    try:
        res = nanolab_here("fit", "--config", str(config), cwd=tmp_path)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("swapper", None)
    return res, runs / "a", runs / "b"


@pytest.mark.slow  # a row of a kind the default run covers (the suite's time)
def test_checkpoints_swapped_for_a_link_to_another_run_mid_run(tmp_path, char_dataset, victim):
    """Item 1: `mv runs/a/checkpoints x; ln -s ../b/checkpoints runs/a/checkpoints` at step 3
    of a run that saves every step and keeps one: it stops with one line at its next save,
    `b`'s files are untouched (none overwritten, none rotated away), `a`'s are in the moved
    folder."""
    before = digests(victim)
    res, a, b = _fit_with_swap(
        tmp_path, char_dataset, victim, name="checkpoints", target="../b/checkpoints"
    )
    detail = f"exit {res.returncode}; stderr tail:\n{res.stderr[-2500:]}"
    assert res.returncode == EXIT_USAGE, detail
    assert "Traceback" not in res.stderr, detail
    line = last_line(res.stderr)
    assert "now leads to" in line and "checkpoints.moved" in line, line
    assert digests(b) == before
    moved = sorted(p.name for p in (a / "checkpoints.moved").iterdir())
    # keep_last 1: one step file from before the swap, and the older one rotation keeps for the
    # spike guard's rollback (docs/callbacks.md)
    steps = moved[1:]
    assert moved[0] == "last.ckpt" and 1 <= len(steps) <= 2, moved
    assert all(s.startswith("step-") and s.endswith(".ckpt") for s in steps), moved
    end = read_records(a / "metrics.jsonl", "end")[-1]
    assert end["reason"] == "error" and end["error"] == line.removeprefix("nanolab fit: error: ")


def test_checkpoints_folder_deleted_mid_run_says_so(tmp_path, char_dataset, victim):
    """`rm -rf runs/a/checkpoints` at step 3: the run stops at its next save with one line that
    says the folder was deleted (not that its files are "intact" somewhere to be put back), and
    the run log's end record holds the same line, without an exception class name."""
    res, a, _ = _fit_with_swap(
        tmp_path, char_dataset, victim, name="checkpoints", target="", how="rmtree"
    )
    detail = f"exit {res.returncode}; stderr tail:\n{res.stderr[-2500:]}"
    assert res.returncode == EXIT_USAGE and "Traceback" not in res.stderr, detail
    line = last_line(res.stderr)
    assert "checkpoints was deleted while the run wrote it" in line and "intact" not in line, line
    end = read_records(a / "metrics.jsonl", "end")[-1]
    assert end["reason"] == "error" and end["error"] == line.removeprefix("nanolab fit: error: ")


def test_run_log_swapped_for_a_link_to_another_runs_log_mid_run(tmp_path, char_dataset, victim):
    """Item 2: `rm runs/a/metrics.jsonl; ln -s ../b/metrics.jsonl runs/a/metrics.jsonl` at
    step 3: the run does not follow the link (not one of its records lands in `b`'s log); it
    stops with one line naming the link, and `b` hashes the same."""
    before = digests(victim)
    res, a, b = _fit_with_swap(
        tmp_path, char_dataset, victim, name="metrics.jsonl", target="../b/metrics.jsonl",
        how="remove",
    )  # fmt: skip
    detail = f"exit {res.returncode}; stderr tail:\n{res.stderr[-2500:]}"
    assert res.returncode == EXIT_USAGE, detail
    assert "Traceback" not in res.stderr, detail
    assert "metrics.jsonl is a link" in last_line(res.stderr), detail
    assert digests(b) == before
    assert (a / "checkpoints" / "last.ckpt").exists()  # the checkpoints are kept


def _recreated_log(run_dir: Path, run_id: str | None) -> None:
    """A run log that lost its `start` record: only what a run writes after `rm metrics.jsonl`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"event": "log_recreated", "time": 0.0, "step": 3, "detail": "recreated"}
    if run_id is not None:
        record["run_id"] = run_id
    (run_dir / "metrics.jsonl").write_text(json.dumps(record) + "\n")


@pytest.mark.parametrize("run_id", ["aaaaaaaaaaaa", None], ids=["log-names-a", "log-names-none"])
def test_a_recreated_log_does_not_adopt_a_copied_checkpoint(tmp_path, run_id) -> None:
    """Item 4 (the claim alone): `runs/a`'s log was recreated, `b`'s `last.ckpt` copied into
    `runs/a/checkpoints/`. Whether the recreated log names `a` or nothing, resuming that file
    here is refused (it would give two directories one run id); `a`'s own file is accepted."""
    from nanolab.callbacks.rundir import RunDirError, claim_run_dir

    a = tmp_path / "runs" / "a"
    _recreated_log(a, run_id)
    (a / "checkpoints").mkdir()
    copied = a / "checkpoints" / "last.ckpt"
    copied.write_bytes(b"stand-in")
    b_dir = str(tmp_path / "runs" / "b")
    with pytest.raises(RunDirError, match="would mix two runs"):
        claim_run_dir(a, None, True, checkpoint=copied, checkpoint_run_id="bbbbbbbbbbbb",
                      checkpoint_run_dir=b_dir)  # fmt: skip
    own = claim_run_dir(a, None, True, checkpoint=copied, checkpoint_run_id=run_id or "a" * 12,
                        checkpoint_run_dir=str(a))  # fmt: skip
    assert own.run_id is None  # resumes under the checkpoint's id


def test_resume_into_a_recreated_log_refuses_another_runs_checkpoint(
    tmp_path, char_dataset, victim
) -> None:
    """Item 4 end to end: `runs/a` holds a recreated log (no `start`, no run id) and a copy of
    `b`'s `last.ckpt`; `nanolab fit --run.name a` (resume auto) refuses in one line instead of
    continuing `b` under `b`'s run id in a second directory. Nothing changes."""
    runs = tmp_path / "runs"
    shutil.copytree(victim, runs / "b")
    a = runs / "a"
    _recreated_log(a, None)
    (a / "checkpoints").mkdir()
    shutil.copy2(victim / "checkpoints" / "last.ckpt", a / "checkpoints" / "last.ckpt")
    before = digests(runs)
    cfg = tiny_overrides(char_dataset, runs, run__name="a", trainer__max_steps=8)
    config = write_config(tmp_path / "a.yaml", cfg)
    res = nanolab_here("fit", "--config", str(config), cwd=tmp_path)  # the swaps: processes
    detail = f"exit {res.returncode}; stderr tail:\n{res.stderr[-2500:]}"
    assert res.returncode == EXIT_USAGE, detail
    assert "Traceback" not in res.stderr, detail
    assert "would mix two runs" in last_line(res.stderr), detail
    after = digests(runs)
    assert {k: after.get(k) for k in before} == before  # nothing changed or removed


def _start_ids(log: Path) -> list[str]:
    return [r["run_id"] for r in read_records(log) if r.get("event") == "start"]


def test_a_run_moved_without_its_log_resumes_as_itself(tmp_path, char_dataset, victim) -> None:
    """A run directory moved elsewhere whose metrics.jsonl was then lost: its checkpoints say
    they were saved in the old place, which no longer holds the run, and every one is this
    run's, so the same command resumes it under its own id. With another run's checkpoint put
    beside them, it is refused in one line naming that run, and nothing changes."""
    runs, moved = tmp_path / "runs", tmp_path / "moved"
    cfg = tiny_overrides(char_dataset, runs, run__name="z")
    cfg["checkpoint"] = {"every_n_steps": 2, "keep_last": 2}
    res = nanolab_here("fit", "--config", str(write_config(tmp_path / "z.yaml", cfg)), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    (run_id,) = _start_ids(runs / "z" / "metrics.jsonl")
    moved.mkdir()
    os.rename(runs / "z", moved / "z")
    (moved / "z" / "metrics.jsonl").unlink()
    other = victim / "checkpoints" / "step-00000004.ckpt"
    shutil.copy2(other, moved / "z" / "checkpoints" / "step-00000002.ckpt")  # b's, not z's
    before = digests(moved)
    cfg = tiny_overrides(char_dataset, moved, run__name="z", trainer__max_steps=8)
    again = ("fit", "--config", str(write_config(tmp_path / "m.yaml", cfg)))
    res = nanolab_here(*again, "--run.resume", "auto", cwd=tmp_path)
    detail = f"exit {res.returncode}; stderr tail:\n{res.stderr[-2500:]}"
    assert res.returncode == EXIT_USAGE and "Traceback" not in res.stderr, detail
    line = last_line(res.stderr)
    assert f"was saved by run {run_id} in {runs / 'z'}" in line, line
    assert f"also holds checkpoints of run {_start_ids(victim / 'metrics.jsonl')[0]}" in line
    assert digests(moved) == before  # config.yaml too: refused before it is written

    (moved / "z" / "checkpoints" / "step-00000002.ckpt").unlink()
    res = nanolab_here(*again, "--run.resume", "auto", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    records = read_records(moved / "z" / "metrics.jsonl")
    assert _start_ids(moved / "z" / "metrics.jsonl") == [run_id]
    assert [r["step"] for r in records if r.get("event") == "end"] == [8]


def test_a_copy_of_a_run_without_its_log_is_refused_with_a_fix_that_works(
    tmp_path, char_dataset, victim
) -> None:
    """The same, but the run is still where its checkpoints were saved (a copy, not a move):
    continuing both would make two runs of one id, so it is refused, naming the original, and
    the fix it gives (a new run.name from the checkpoint) runs."""
    _, config, line = _resume_a_copy_is_refused(tmp_path, char_dataset, victim, log=False)
    assert f"in {victim}, which still holds that run" in line, line
    fix = line.rsplit("(", 1)[1].rstrip(")").split()
    assert fix[0] == "--run.resume", line
    res = nanolab_here("fit", "--config", config, *fix, "--run.name", "b2", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]


def _resume_a_copy_is_refused(
    tmp_path: Path, char_dataset: Path, victim: Path, log: bool
) -> tuple[Path, str, str]:
    """``victim`` copied to ``copy/b`` (with its log or without), resumed there: refused in one
    line (exit 2, no traceback) before anything in the copy is written (config.yaml, the log).
    Returns the copy's root, the config that resumes it and the refusal line."""
    copy = tmp_path / "copy"
    shutil.copytree(victim, copy / "b")
    if not log:
        (copy / "b" / "metrics.jsonl").unlink()
    before = digests(copy)
    cfg = tiny_overrides(char_dataset, copy, run__name="b", trainer__max_steps=8)
    config = str(write_config(tmp_path / "c.yaml", cfg))
    res = nanolab_here("fit", "--config", config, "--run.resume", "auto", cwd=tmp_path)
    detail = f"exit {res.returncode}; stderr tail:\n{res.stderr[-2500:]}"
    assert res.returncode == EXIT_USAGE and "Traceback" not in res.stderr, detail
    assert digests(copy) == before
    return copy, config, last_line(res.stderr)


def _run_log(run_dir: Path, run_id: str, where: Path) -> None:
    """A run directory whose log's one launch ran in ``where``, with a checkpoint file."""
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    record = {"event": "start", "time": 0.0, "step": 0, "run_id": run_id, "run_dir": str(where)}
    (run_dir / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    (run_dir / "checkpoints" / "step-00000004.ckpt").write_bytes(b"stand-in")


def test_a_checkpoint_saved_by_a_copy_of_this_run_does_not_continue_here(tmp_path) -> None:
    """`runs/b` is a copy of `runs/a` with its log (both name run `r`), and b trained on: b's
    checkpoint resumed into a would splice b's steps into a's timeline, so it is refused naming
    both directories. A backup of a's own checkpoint kept elsewhere (saved by a) resumes."""
    from nanolab.callbacks.rundir import RunDirError, claim_run_dir

    a, b, rid = tmp_path / "runs" / "a", tmp_path / "runs" / "b", "r" * 12
    _run_log(a, rid, a)
    _run_log(b, rid, a)  # the copy's log: its first launch ran in a
    theirs = b / "checkpoints" / "step-00000004.ckpt"
    with pytest.raises(RunDirError, match="would make two runs of one id") as refused:
        claim_run_dir(a, None, True, checkpoint=theirs, checkpoint_run_id=rid,
                      checkpoint_run_dir=str(b))  # fmt: skip
    assert f"of {b}, which still holds that run" in str(refused.value)
    assert f"continuing it in {a} too" in str(refused.value)
    backup = tmp_path / "backup" / "step-00000004.ckpt"
    backup.parent.mkdir()
    backup.write_bytes(b"stand-in")
    own = claim_run_dir(a, None, True, checkpoint=backup, checkpoint_run_id=rid,
                        checkpoint_run_dir=str(a))  # fmt: skip
    assert own.run_id is None  # resumes as run r


@pytest.mark.parametrize(
    ("log", "said"),
    [
        (None, "has no run log"),
        (b"", "has an empty run log (metrics.jsonl, 0 bytes)"),
        (b'{"event": "st', "has a run log without a whole record (metrics.jsonl, 13 bytes)"),
    ],
)
def test_a_copy_whose_log_holds_no_record_is_refused_saying_what_its_log_is(
    tmp_path, log, said
) -> None:
    """A copy of run `a` whose metrics.jsonl was emptied (0 bytes) was refused as having "no
    run log", though the file is there: the line says what the log is."""
    from nanolab.callbacks.rundir import RunDirError, claim_run_dir

    a, b, rid = tmp_path / "runs" / "a", tmp_path / "runs" / "b", "r" * 12
    _run_log(a, rid, a)
    _run_log(b, rid, a)
    if log is None:
        (b / "metrics.jsonl").unlink()
    else:
        (b / "metrics.jsonl").write_bytes(log)
    own = b / "checkpoints" / "step-00000004.ckpt"
    with pytest.raises(RunDirError, match="could make two copies of one run") as refused:
        claim_run_dir(b, None, True, checkpoint=own, checkpoint_run_id=rid,
                      checkpoint_run_dir=str(a))  # fmt: skip
    assert f"run directory {b} {said}, and {own} was saved by run {rid} in {a}" in str(
        refused.value
    )


def test_a_copy_of_a_run_with_its_log_is_refused_and_a_move_resumes(
    tmp_path, char_dataset, victim
) -> None:
    """`cp -r runs/b copy/b` with its log: both logs name one run, and the copy's checkpoints
    say they were saved in the original, which still holds it, so resuming the copy is refused
    in one line naming both and nothing changes. Once the original is moved away (the copy is
    now the run, moved with its log) the same command resumes it under its own id."""
    copy, config, line = _resume_a_copy_is_refused(tmp_path, char_dataset, victim, log=True)
    assert f"of {victim}, which still holds that run" in line, line
    assert f"continuing it in {copy / 'b'} too" in line, line

    origin = victim.parent / "b.moved"
    os.rename(victim, origin)  # the original is gone: the copy is the run, moved
    try:
        res = nanolab_here("fit", "--config", config, "--run.resume", "auto", cwd=tmp_path)
    finally:
        os.rename(origin, victim)
    assert res.returncode == 0, res.stderr[-3000:]
    (run_id,) = set(_start_ids(victim / "metrics.jsonl"))
    assert set(_start_ids(copy / "b" / "metrics.jsonl")) == {run_id}
    ends = [r["step"] for r in read_records(copy / "b" / "metrics.jsonl") if r["event"] == "end"]
    assert ends[-1] == 8


def queue(capsys, db: Path, *argv: str) -> tuple[int, str, str]:
    """``nanolab queue VERB --db DB ARGS`` in this process; (exit code, stdout, stderr)."""
    from nanolab.queue.cli import main

    code = main([argv[0], "--db", str(db), *argv[1:]])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_sweep_names_its_jobs_by_the_swept_values_and_the_seed(
    tmp_path, char_dataset, capsys, monkeypatch
) -> None:
    """Item 6: a 2x2 sweep with five fixed `--set`s is named `<config>-<swept values>-s<seed>`;
    the fixed overrides are in each job's arguments, not its name."""
    monkeypatch.chdir(tmp_path)
    cfg = tiny_overrides(char_dataset, tmp_path / "runs")
    del cfg["run"]["name"]
    config = write_config(tmp_path / "quickstart.yaml", cfg)
    fixed = ["trainer.max_steps=40", "downstream.suite=null", "model.gpt.n_layer=2",
             "model.gpt.n_embd=64", "run.eval_every_steps=20"]  # fmt: skip
    sets = [a for s in fixed for a in ("--set", s)]
    code, _, err = queue(capsys, tmp_path / "q.db", "add", str(config), *sets, "--seeds", "1",
                         "--sweep", "model.optimizer.lr=1e-3,3e-3",
                         "--sweep", "model.gpt.n_head=2,4")  # fmt: skip
    assert code == 0, err
    from nanolab.queue.db import QueueDB

    jobs = QueueDB(tmp_path / "q.db").jobs()
    assert [j.name for j in jobs] == [
        "quickstart-lr1e-3-n_head2-s1", "quickstart-lr1e-3-n_head4-s1",
        "quickstart-lr3e-3-n_head2-s1", "quickstart-lr3e-3-n_head4-s1",
    ]  # fmt: skip
    assert "--trainer.max_steps=40" in jobs[0].args and "--run.eval_every_steps=20" in jobs[0].args


@pytest.mark.parametrize(
    ("verb", "argv"),
    [
        ("export", ["--ckpt", "{run}/checkpoints/last.ckpt", "-o", "{target}"]),
        ("init", ["{target}"]),
        ("prepare", ["bundled:shakespeare", "-o", "{target}"]),
    ],
)
@pytest.mark.parametrize("via", ["path", "link"])
def test_no_output_folder_inside_a_run_directory(tmp_path, capsys, verb, argv, via) -> None:
    """Item 5: `export -o`, `init` and `prepare -o` into a folder inside a run directory (also
    through a link to it) are refused in one line, as `eval --json` and `report --plot` are:
    one rule (`nanolab.runlog.refuse_inside_run`), and nothing is written."""
    import importlib

    run = tmp_path / "runs" / "b"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"event": "start", "run_id": "b"}\n')
    if via == "link":
        (tmp_path / "elsewhere").symlink_to(run)
        target = tmp_path / "elsewhere" / "out"
    else:
        target = run / "out"
    module = {"export": "nanolab.export", "init": "nanolab.scaffold",
              "prepare": "nanolab.data.prepare"}[verb]  # fmt: skip
    main = importlib.import_module(module).main
    before = digests(tmp_path / "runs")
    code = main([a.format(run=run, target=target) for a in argv])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE, err
    assert len(err.strip().splitlines()) == 1 and "inside the run directory" in err, err
    assert digests(tmp_path / "runs") == before and not (run / "out").exists()


@pytest.mark.parametrize("verb", ["export", "prepare"])
@pytest.mark.parametrize("log", ["foreign", "nanolab"])
def test_only_a_nanolab_run_log_makes_a_folder_a_run(tmp_path, capsys, verb, log) -> None:
    """`prepare -o` and `export -o` go by fit's rule for what a run is: a folder whose
    metrics.jsonl another tool wrote (a project's own metrics) is not a run, so writing below
    it is allowed; below a run nanolab wrote it is refused in one line. They refused any
    folder holding a metrics.jsonl, while fit itself trained in such a folder."""
    from dataclasses import asdict

    import torch

    from nanolab.data.prepare import main as prepare_main
    from nanolab.export import main as export_main
    from nanolab.model import GPT, GPTConfig

    project = tmp_path / "project"
    project.mkdir()
    record = {
        "foreign": {"epoch": 1, "accuracy": 0.9},
        "nanolab": {"event": "start", "run_id": "b"},
    }
    (project / "metrics.jsonl").write_text(json.dumps(record[log]) + "\n")
    config = GPTConfig(vocab_size=65, n_layer=1, n_head=2, n_embd=16, block_size=8)
    ckpt = {
        "state_dict": {f"model.{k}": v for k, v in GPT(config).state_dict().items()},
        "nanolab": {"gpt": asdict(config), "tokenizer": None},
    }
    torch.save(ckpt, tmp_path / "w.ckpt")
    target = project / "out"
    if verb == "export":
        code = export_main(["--ckpt", str(tmp_path / "w.ckpt"), "--format", "safetensors",
                            "-o", str(target)])  # fmt: skip
    else:
        code = prepare_main(["bundled:shakespeare", "-o", str(target)])
    err = capsys.readouterr().err
    if log == "foreign":
        assert code == 0, err
        assert target.is_dir() and "inside the run directory" not in err
    else:
        assert code == EXIT_USAGE, err
        assert err.strip() == (
            f"nanolab {verb}: error: -o {target} is inside the run directory {project}; write "
            "it elsewhere (a run's files are its own)"
        )
        assert not target.exists()


@pytest.mark.parametrize(
    ("root", "name", "said"),
    [
        ("runs/b", "checkpoints", "is inside the run directory"),  # run.root in the run
        ("elsewhere", "checkpoints", "is inside the run directory"),  # a link to the run
        ("runs", "alias", "is a link into the run directory"),  # run_dir links into it
    ],
)
def test_fit_refuses_a_run_directory_inside_another_run(
    tmp_path, char_dataset, root, name, said
) -> None:
    """`--run.root runs/b --run.name checkpoints` put config.yaml, metrics.jsonl and the lock
    among run b's checkpoints: the run directory is refused inside another run's, as every
    other output folder is, also through a link, in one line (exit 2), before anything is
    written."""
    run = tmp_path / "runs" / "b"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"event": "start", "run_id": "b"}\n')
    (tmp_path / "elsewhere").symlink_to(run)
    (tmp_path / "runs" / "alias").symlink_to(run / "checkpoints")
    write_config(tmp_path / "tiny.yaml", tiny_overrides(char_dataset, Path("runs")))
    before = digests(tmp_path / "runs")
    res = nanolab_here(
        "fit", "--config", "tiny.yaml", "--run.root", root, "--run.name", name, cwd=tmp_path
    )
    assert res.returncode == EXIT_USAGE and "Traceback" not in res.stderr, res.stderr[-2000:]
    (line,) = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert said in line and str(run) in line and ("run.root" in line or "run.name" in line), line
    assert digests(tmp_path / "runs") == before
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "metrics.jsonl"]


def test_queue_add_names_an_existing_fit_run(tmp_path, char_dataset, victim, capsys, monkeypatch):
    """Item 3: `queue add --name b` where `runs/b` is a finished run of `nanolab fit`: refused
    at add time in one line naming the step it would continue from; `--continue` queues it and
    says so in one line; a model shape that cannot resume it is refused at add time. The run's
    files are untouched throughout."""
    from nanolab.queue.db import QueueDB

    monkeypatch.chdir(tmp_path)
    runs = tmp_path / "runs"
    shutil.copytree(victim, runs / "b")
    before = digests(runs / "b")
    cfg = tiny_overrides(char_dataset, runs, trainer__max_steps=8)
    del cfg["run"]["name"]
    config = write_config(tmp_path / "tiny.yaml", cfg)
    db = tmp_path / "q.db"

    code, _, err = queue(capsys, db, "add", str(config), "--name", "b")
    assert code == EXIT_USAGE and len(err.strip().splitlines()) == 1, err
    assert "existing run started by nanolab fit" in err and "from step 6" in err, err
    assert "--continue" in err

    code, _, err = queue(capsys, db, "add", str(config), "--name", "b", "--continue",
                         "--set", "model.gpt.n_layer=3")  # fmt: skip
    assert code == EXIT_USAGE and len(err.strip().splitlines()) == 1, err
    assert "different model" in err and "n_layer 2 in the checkpoint vs 3 now" in err, err
    assert QueueDB(db).jobs() == []

    code, _, err = queue(capsys, db, "add", str(config), "--name", "b", "--continue")
    assert code == 0, err
    assert f"job b continues the existing run {runs / 'b'} from step 6" in err, err
    assert [j.name for j in QueueDB(db).jobs()] == ["b"]
    assert digests(runs / "b") == before


def test_rotation_deletes_only_files_it_recorded(tmp_path) -> None:
    """Rotation's own record decides what it may delete: a step file it wrote goes, a file
    copied in under a step name (another run's checkpoint, same name) stays."""
    from nanolab.callbacks.checkpoint import RotatingCheckpoint
    from nanolab.claimed import ClaimedDir

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    ckpt = RotatingCheckpoint(every_n_steps=1, keep_last=1, keep_best=0)
    ckpt.dirpath = folder
    ckpt._folder = ClaimedDir(folder)
    for step in (1, 3):
        (folder / f"step-{step:08d}.ckpt").write_bytes(b"ours")
        ckpt._remember(f"step-{step:08d}.ckpt")
    (folder / "step-00000002.ckpt").write_bytes(b"copied in from another run")
    deleted = ckpt._rotate(folder / "step-00000003.ckpt", 3, {})
    assert [p.name for p in deleted] == ["step-00000001.ckpt"]
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000002.ckpt", "step-00000003.ckpt"]
    ckpt._close_folder()


def test_rotation_and_the_disk_cap_delete_sharded_checkpoint_folders(tmp_path, capsys) -> None:
    """DeepSpeed and FSDP2's distributed saves write each checkpoint as a folder; rotation
    refused every folder (its record held regular files only), so keep_last and max_disk_gb
    did nothing and a night of 350M saves filled the disk. A folder it wrote now goes, through
    a hidden name (a crash mid-delete never leaves half a checkpoint under a step name); a
    folder copied in under a step name stays, as a file does."""
    from nanolab.callbacks.checkpoint import LAST_NAME, RotatingCheckpoint
    from nanolab.callbacks.checkpoint_io import atomic_link
    from nanolab.claimed import ClaimedDir

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    ckpt = RotatingCheckpoint(every_n_steps=1, keep_last=1, keep_best=0, max_disk_gb=1e-6)
    ckpt.dirpath = folder
    ckpt._folder = ClaimedDir(folder)

    def save(step: int) -> Path:
        shards = folder / f"step-{step:08d}.ckpt"
        (shards / "checkpoint").mkdir(parents=True)
        for rank in range(2):
            (shards / "checkpoint" / f"rank{rank}_model_states.pt").write_bytes(b"x" * 600)
        ckpt._remember(shards.name)
        atomic_link(shards, folder / LAST_NAME, ckpt._folder)
        return shards

    for step in (1, 2):
        save(step)
    copied = folder / "step-00000003.ckpt"
    (copied / "checkpoint").mkdir(parents=True)  # another run's folder put here by hand
    newest = save(4)
    deleted = ckpt._rotate(newest, 4, {})
    assert "smaller than one checkpoint (1 kB on disk)" in capsys.readouterr().err
    assert sorted(p.name for p in deleted) == ["step-00000001.ckpt", "step-00000002.ckpt"]
    assert sorted(p.name for p in folder.iterdir()) == [
        LAST_NAME, "step-00000003.ckpt", "step-00000004.ckpt",
    ]  # fmt: skip
    assert (folder / LAST_NAME).resolve() == newest.resolve()
    ckpt._close_folder()


def test_queue_add_and_fit_refuse_a_config_kept_where_the_run_will_write(
    tmp_path, char_dataset, capsys, monkeypatch
):
    """A job's own ``--config`` saved as ``runs/exp/config.yaml`` (the folder the job's run
    will use): the run would replace it with its merged config at its first launch and the
    queue would then refuse every restart ("config changed"). Refused at ``queue add`` and by
    ``fit``, one line, the file untouched."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "exp"
    run.mkdir(parents=True)
    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=2)
    cfg["run"]["name"] = "exp"
    config = write_config(run / "config.yaml", cfg)
    before = digests(run)
    code, _, err = queue(capsys, tmp_path / "q.db", "add", str(config), "--name", "exp")
    assert code == EXIT_USAGE and len(err.strip().splitlines()) == 1, err
    assert "config.yaml is not a config a run wrote" in err and "move that file" in err, err
    proc = nanolab_here("fit", "--config", str(config), cwd=tmp_path)
    assert proc.returncode == EXIT_USAGE and "is not a config a run wrote" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert digests(run) == before


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_a_run_log_that_is_a_link_naming_no_run_is_said_as_what_it_is(tmp_path, kind) -> None:
    """A `metrics.jsonl` that is a link (symbolic, or a hard link) to a file naming no run was
    refused as "run directory X already holds another run" (or, empty, only once training had
    started): now before anything is written, in one line saying it is a link; `run.fresh`
    moves the link aside and leaves the file it shares alone."""
    from nanolab.callbacks.rundir import RunDirError, claim_run_dir

    notes = tmp_path / "notes.jsonl"
    notes.write_text('{"note": "mine"}\n')
    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    if kind == "symlink":
        (run / "metrics.jsonl").symlink_to(notes)
        said = f"{run / 'metrics.jsonl'} is a link to {notes} that names no run"
    else:
        os.link(notes, run / "metrics.jsonl")
        said = f"{run / 'metrics.jsonl'} is a hard link (2 names for one file) that names no run"
    with pytest.raises(RunDirError) as refused:
        claim_run_dir(run, {"model": {}}, resuming=False)
    assert str(refused.value).startswith(said) and "already holds" not in str(refused.value)
    assert sorted(os.listdir(run)) == ["metrics.jsonl"]
    claim = claim_run_dir(run, {"model": {}}, resuming=False, fresh=True)
    assert claim.archived_to is not None and not (run / "metrics.jsonl").exists()
    assert notes.read_text() == '{"note": "mine"}\n'


@pytest.mark.parametrize(
    ("log", "checkpoint", "refused"),
    [
        ('{"epoch": 1}\n', None, False),  # another tool's metrics.jsonl in a project folder
        ("", None, False),  # an empty file of that name
        ('{"event": "start", "run_id": "b"}\n', None, True),  # a nanolab run
        ('{"epoch": 1}\n', "step-00000003.ckpt", True),  # a nanolab run whose log was replaced
        ('{"epoch": 1}\n', "model.ckpt", False),  # a checkpoint nanolab does not name so
    ],
)
def test_only_a_nanolab_run_holds_a_run_root(tmp_path, log, checkpoint, refused) -> None:
    """A run root under a folder holding a ``metrics.jsonl`` that no nanolab run wrote is not
    inside a run: fit refused every run root of a project that kept another tool's log."""
    from nanolab.callbacks.rundir import RunDirError, refuse_nested_run_dir

    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "metrics.jsonl").write_text(log)
    if checkpoint:
        (proj / "checkpoints").mkdir()
        (proj / "checkpoints" / checkpoint).write_bytes(b"")
    for run_dir in (proj / "runs" / "a", proj / "a"):
        if refused:
            with pytest.raises(RunDirError, match=f"inside the run directory {proj}"):
                refuse_nested_run_dir(run_dir)
        else:
            refuse_nested_run_dir(run_dir)


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_a_queue_log_linked_to_another_runs_log_is_left_alone(tmp_path, monkeypatch, kind) -> None:
    """A ``queue.log`` in a job's run directory that was a link to another run's
    ``metrics.jsonl`` took the job's console output: the runner appended through it. The job's
    output now goes to ``nanolab_queue_logs/<id>-<name>.log`` beside the database, the runner
    says so in one line, and the other run's log hashes the same."""
    import io
    import sys

    from nanolab.queue import runner as runner_mod
    from nanolab.queue.db import NewJob, QueueDB

    real = subprocess.Popen

    def popen(cmd, **kwargs):  # the job's fit stands in as one line of console output
        return real([sys.executable, "-c", "print('console output of the job')"], **kwargs)

    monkeypatch.setattr(runner_mod.subprocess, "Popen", popen)
    victim_log = tmp_path / "runs" / "victim" / "metrics.jsonl"
    victim_log.parent.mkdir(parents=True)
    victim_log.write_text('{"event": "start", "time": 1.0, "step": 0}\n')
    before = digests(victim_log.parent)
    link = tmp_path / "runs" / "j" / "queue.log"
    link.parent.mkdir()
    if kind == "symlink":
        link.symlink_to("../victim/metrics.jsonl")
    else:
        os.link(victim_log, link)
    path = tmp_path / "q.db"
    QueueDB(path).add_jobs([NewJob(name="j", config="c.yaml", args=[], seed=None,
                                   cwd=str(tmp_path), run_dir=str(link.parent))])  # fmt: skip
    said = io.StringIO()
    runner_mod.Runner(QueueDB(path), out=said, poll_s=0.01).run()
    assert digests(victim_log.parent) == before, said.getvalue()
    spare = tmp_path / "nanolab_queue_logs" / "0001-j.log"
    assert "console output of the job" in spare.read_text(), said.getvalue()
    (job,) = QueueDB(path).jobs()
    assert job.status == "done" and job.log == str(spare), said.getvalue()
    what = "is a link" if kind == "symlink" else "is a hard link (2 names for one file)"
    moved = [line for line in said.getvalue().splitlines() if "left as it is" in line]
    assert len(moved) == 1 and f"its log {link} {what}" in moved[0], said.getvalue()
    assert f"its output goes to {spare}" in moved[0], moved[0]


def test_a_run_directory_that_is_a_link_gets_no_queue_log_through_it(tmp_path, monkeypatch):
    """A job whose run directory was itself a symbolic link (to another run's folder) had its
    ``queue.log`` written through it, into that run's folder: only a ``queue.log`` that was a
    link was caught. Its output now goes to ``nanolab_queue_logs/<id>-<name>.log``, said in
    one line, and the other run's folder is left as it was."""
    import io
    import sys

    from nanolab.queue import runner as runner_mod
    from nanolab.queue.db import NewJob, QueueDB

    real = subprocess.Popen

    def popen(cmd, **kwargs):  # the job's fit stands in as one line of console output
        return real([sys.executable, "-c", "print('console output of the job')"], **kwargs)

    monkeypatch.setattr(runner_mod.subprocess, "Popen", popen)
    victim = tmp_path / "runs" / "victim"
    victim.mkdir(parents=True)
    (victim / "metrics.jsonl").write_text('{"event": "start", "time": 1.0, "step": 0}\n')
    before = digests(victim)
    link = tmp_path / "runs" / "j"
    link.symlink_to("victim")
    path = tmp_path / "q.db"
    QueueDB(path).add_jobs([NewJob(name="j", config="c.yaml", args=[], seed=None,
                                   cwd=str(tmp_path), run_dir=str(link))])  # fmt: skip
    said = io.StringIO()
    runner_mod.Runner(QueueDB(path), out=said, poll_s=0.01).run()
    assert digests(victim) == before and not (victim / "queue.log").exists(), said.getvalue()
    spare = tmp_path / "nanolab_queue_logs" / "0001-j.log"
    assert "console output of the job" in spare.read_text(), said.getvalue()
    (job,) = QueueDB(path).jobs()
    assert job.status == "done" and job.log == str(spare), said.getvalue()
    moved = [line for line in said.getvalue().splitlines() if "left as it is" in line]
    assert len(moved) == 1, said.getvalue()
    assert f"is in a run directory that is a link ({link} -> victim)" in moved[0], moved[0]
    assert f"its output goes to {spare}" in moved[0], moved[0]
