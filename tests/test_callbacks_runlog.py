"""The run log format (reader/writer) and the in-process Trainer helpers the callback tests share."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import lightning as L
import torch

from nanolab.data.datamodule import TokenDataModule
from nanolab.model import GPTConfig
from nanolab.runlog import RunLogWriter, dumps, iter_records, last_record, read_records
from nanolab.training.module import GPTLightningModule
from nanolab.training.optim import ScheduleConfig

MICRO, BLOCK = 4, 16
TOKENS_PER_MICRO_BATCH = MICRO * BLOCK


# -- helpers for the other test_callbacks_* files ---------------------------------------------
class ScriptedModule(GPTLightningModule):
    """The real module; optionally logs extra metrics (``log_every``: ``train/every`` = the step
    at every that many steps), scripted val losses, or fails at a step."""

    def __init__(
        self,
        *args: Any,
        val_losses: list[float] | None = None,
        fail_at_step: int | None = None,
        extra_logs: bool = False,
        log_every: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.val_losses = val_losses
        self.fail_at_step = fail_at_step
        self.extra_logs = extra_logs
        self.log_every = log_every
        self._evals = 0

    def training_step(self, batch, batch_idx):
        if self.fail_at_step is not None and self.trainer.global_step == self.fail_at_step:
            raise RuntimeError(f"scripted failure at step {self.fail_at_step}")
        loss = super().training_step(batch, batch_idx)
        if self.extra_logs:
            self.log("train/aux", loss.detach() * 2)
        step = self.trainer.global_step + 1  # the step this micro-batch trains
        if self.log_every and step % self.log_every == 0:
            self.log("train/every", float(step))
        return loss

    def validation_step(self, batch, batch_idx):
        if self.val_losses is None:
            super().validation_step(batch, batch_idx)
            if self.extra_logs:
                self.log("val/acc", 0.25, batch_size=batch[0].size(0))
            return
        value = self.val_losses[min(self._evals, len(self.val_losses) - 1)]
        self.log("val/loss", torch.tensor(value), batch_size=batch[0].size(0))

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            self._evals += 1


def make_module(dataset: Path, **kwargs: Any) -> tuple[ScriptedModule, TokenDataModule]:
    dm = TokenDataModule(
        dataset_dir=str(dataset),
        source=None,
        micro_batch_size=MICRO,
        block_size=BLOCK,
        val_windows=8,
    )
    gpt = GPTConfig(vocab_size=dm.vocab_size, block_size=BLOCK, n_layer=2, n_head=2, n_embd=32)
    module = ScriptedModule(gpt=gpt, **{"schedule": ScheduleConfig(warmup_steps=2), **kwargs})
    return module, dm


def fit(
    run_dir: Path,
    dataset: Path,
    callbacks: list[L.Callback],
    max_steps: int = 8,
    eval_every: int = 4,
    accumulate: int = 1,
    ckpt_path: str | Path | None = None,
    module_kwargs: dict[str, Any] | None = None,
    **trainer_kwargs: Any,
) -> L.Trainer:
    """A real fit on CPU with the tiny model: a few milliseconds a step."""
    module, dm = make_module(dataset, **(module_kwargs or {}))
    trainer = L.Trainer(
        default_root_dir=str(run_dir),
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        val_check_interval=eval_every * accumulate,
        check_val_every_n_epoch=None,
        accumulate_grad_batches=accumulate,
        callbacks=callbacks,
        **{"enable_progress_bar": False, "logger": False, **trainer_kwargs},
    )
    trainer.fit(module, dm, ckpt_path=str(ckpt_path) if ckpt_path else None, weights_only=True)
    return trainer


def events(path: Path, kind: str) -> list[dict[str, Any]]:
    return read_records(path, kind)


# -- the format itself -------------------------------------------------------------------------
def test_reader_skips_a_half_written_line_and_the_writer_starts_a_fresh_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = RunLogWriter(path)
    writer.write({"event": "train", "time": 1.0, "step": 1, "loss": 2.0})
    writer.close()
    with open(path, "a") as f:
        f.write('{"event": "train", "time": 2.0, "st')  # the process died mid-line
    before = path.read_bytes()

    writer = RunLogWriter(path)  # the resumed process
    writer.write({"event": "train", "time": 3.0, "step": 2, "loss": 1.5})
    writer.close()

    assert path.read_bytes().startswith(before)  # appended, never rewritten
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and lines[1].endswith('"st')
    steps = [r["step"] for r in read_records(path)]
    assert steps == [1, 2]
    assert last_record(path)["step"] == 2
    assert [r["step"] for r in iter_records(path, "train")] == [1, 2]


def test_last_record_reads_backwards_across_chunks(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = RunLogWriter(path)
    for step in range(500):
        writer.write(
            {"event": "val" if step % 100 == 7 else "train", "step": step, "pad": "x" * 50}
        )
    writer.close()
    assert last_record(path, chunk=64)["step"] == 499
    assert last_record(path, "val", chunk=64)["step"] == 407
    assert last_record(path, where=lambda r: r["step"] < 3, chunk=64)["step"] == 2
    assert last_record(tmp_path / "missing.jsonl") is None
    assert read_records(tmp_path / "missing.jsonl") == []


def test_last_record_matches_a_whole_file_parse_whatever_the_damage_and_chunk(tmp_path):
    # Zero-filled tails (a power loss), torn lines, lines that span many chunks, no final
    # newline: the backward reader finds what reading every line would, at any chunk size.
    import random

    def every_line(path: Path, event: str | None) -> dict | None:
        for raw in reversed(path.read_bytes().split(b"\n")):
            try:
                record = json.loads(raw.decode("utf-8", errors="replace"))
            except ValueError:
                continue
            if isinstance(record, dict) and (event is None or record.get("event") == event):
                return record
        return None

    rng = random.Random(0)
    path = tmp_path / "metrics.jsonl"
    for _ in range(150):
        parts = []
        for i in range(rng.randint(0, 20)):
            roll = rng.random()
            if roll < 0.6:
                kind = rng.choice(["train", "val", "start"])
                parts.append(json.dumps({"event": kind, "i": i, "pad": "x" * rng.randint(0, 300)}))
            elif roll < 0.8:
                parts.append("\0" * rng.randint(0, 500))
            else:
                parts.append('{"event": "train", "step": 5, "lo')
        path.write_text("\n".join(parts) + rng.choice(["", "\n"]))
        for event in (None, "start", "val"):
            for chunk in (1, 7, 64, 1 << 16):
                assert last_record(path, event, chunk=chunk) == every_line(path, event)


def test_a_line_longer_than_any_record_is_skipped_not_held(tmp_path, monkeypatch):
    import nanolab.runlog as runlog

    monkeypatch.setattr(runlog, "MAX_RECORD_BYTES", 1000)
    path = tmp_path / "metrics.jsonl"
    big = json.dumps({"event": "start", "pad": "x" * 5000})  # a record, but past the bound
    path.write_text(json.dumps({"event": "start", "i": 1}) + "\n" + big + "\n" + "\0" * 9000)
    assert last_record(path, "start", chunk=64) == {"event": "start", "i": 1}
    # the forward reader too (report, status): it held the longest line, 2x its size in RSS
    after = json.dumps({"event": "end", "i": 3})
    path.write_text(json.dumps({"event": "start", "i": 1}) + "\n" + big + "\n" + after + "\n")
    assert [(n, r["i"]) for n, r in runlog.iter_numbered(path)] == [(0, 1), (2, 3)]


def test_a_line_nested_deeper_than_json_reads_is_damage_not_a_traceback(tmp_path):
    """``[`` x 1,000 appended to a log raised RecursionError in report, status and a resume."""
    log = tmp_path / "metrics.jsonl"
    log.write_text(dumps({"event": "train", "step": 1}) + "\n" + "[" * 1000 + "\n")
    assert [r["step"] for r in iter_records(log)] == [1]
    assert last_record(log)["step"] == 1


def test_records_are_strict_json(tmp_path):
    line = dumps({"a": math.nan, "b": [math.inf, 1.0], "c": Path("/x")})
    assert json.loads(line) == {"a": None, "b": [None, 1.0], "c": "/x"}
    assert "\n" not in line


def test_reading_the_git_state_writes_nothing_into_the_users_repository(tmp_path, monkeypatch):
    """The start record's commit and dirtiness come from ``git status``, which by default
    refreshes a stale index by rewriting it under ``index.lock``: a git command the user runs
    in that checkout at the same moment would fail. Mutation caught: without
    ``--no-optional-locks`` the index is rewritten (its bytes and time change)."""
    import os
    import subprocess

    from nanolab.callbacks.jsonl import git_state

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "train.py").write_text("print(1)\n")
    git("add", "train.py")
    git(
        "-c",
        "user.email=a@b",
        "-c",
        "user.name=n",
        "-c",
        "commit.gpgsign=false",
        "commit",
        "-qm",
        "one",
    )
    index = tmp_path / ".git" / "index"
    os.utime(index, (1_000_000_000, 1_000_000_000))  # older than the file: the index is stale
    before = (index.read_bytes(), index.stat().st_mtime_ns)
    monkeypatch.chdir(tmp_path)
    state = git_state()
    assert state["git_dirty"] is False and len(state["git_commit"]) == 40
    assert (index.read_bytes(), index.stat().st_mtime_ns) == before


def test_reading_by_event_parses_only_the_lines_that_can_hold_it(tmp_path):
    """The escaped spelling of an event, a carriage return inside a line, torn lines: reading
    by event finds what parsing every line would, forwards and backwards, at any chunk."""
    import random

    from nanolab.runlog import iter_backwards

    rng = random.Random(1)
    path = tmp_path / "metrics.jsonl"
    for _ in range(120):
        parts = []
        for i in range(rng.randint(0, 16)):
            roll = rng.random()
            kind = rng.choice(["train", "start", "log_recreated", "\\u0073tart"])
            if roll < 0.7:
                parts.append(
                    f'{{"event": "{kind}", "i": {i}, "pad": "{"x" * rng.randint(0, 90)}"}}'
                )
            elif roll < 0.8:
                parts.append(f'{{"event":"{kind}","i":{i}}}\r{{"event":"start","i":{i}}}')
            else:
                parts.append('{"event": "start", "step": 5, "lo')
        path.write_text("\n".join(parts) + rng.choice(["", "\n"]), newline="")
        every = list(iter_records(path))
        for event in ("start", ("start", "log_recreated")):
            want = [
                r for r in every if r["event"] in ((event,) if isinstance(event, str) else event)
            ]
            if isinstance(event, str):
                assert list(iter_records(path, event)) == want
            for chunk in (1, 7, 64, 1 << 16):
                got = list(iter_backwards(path, event, chunk=chunk, split_cr=True))
                assert got == want[::-1]


def test_a_resume_reads_a_long_logs_start_without_parsing_the_log(tmp_path, monkeypatch):
    """Resuming a 2M-step run parsed every line several times before its first step (the one
    start record is on line 1): claiming the folder and checking the rollback ledger now parse
    only the lines that can be a start, log_recreated or spike record."""
    import nanolab.runlog as runlog
    from nanolab.callbacks.rundir import claim_run_dir, owner_of_log
    from nanolab.callbacks.spike import check_ledger

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    train = dumps({"event": "train", "time": 1.0, "step": 1, "loss": 2.0, "tokens": 128})
    with open(run_dir / "metrics.jsonl", "w") as f:
        f.write(dumps({"event": "start", "time": 0.0, "step": 0, "run_id": "abc"}) + "\n")
        for _ in range(100_000):
            f.write(train + "\n")
    parsed = []
    real = runlog._parse
    monkeypatch.setattr(runlog, "_parse", lambda line: parsed.append(1) or real(line))
    assert owner_of_log(run_dir / "metrics.jsonl") == "abc"
    claim_run_dir(run_dir, {"model": {}}, resuming=True)
    check_ledger(run_dir)
    assert len(parsed) < 10
