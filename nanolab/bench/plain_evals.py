"""What the plain loop does between steps: validate, score the task suite, save a checkpoint.

``nanolab fit`` validates, scores its in-loop tasks and saves checkpoints at the cadence its
config gives; a loop that does none of that finishes sooner for reasons that are not speed. So
the plain loop of ``nanolab bench`` does the same work at the same steps, the way a careful
hand-written loop does it (nanoGPT's ``estimate_loss`` and ``torch.save``):

* **validation** every ``run.eval_every_steps`` steps: the same ``data.val_windows`` fixed
  windows of the validation split, in micro-batches (``trainer.limit_val_batches`` of them, as
  Lightning reads it), without gradients; the mean loss is read
  (and returned, so the bench can check both sides validated the same model the same way);
* **tasks** after every ``downstream.every_n_evals``-th validation and once more on the final
  model: nanolab's own scorer on the same suite and limit (scoring is model work, not framework
  work), eager even when the model is compiled, as ``fit`` scores them;
* **checkpoints** every ``checkpoint.every_n_steps`` steps (after that step's validation) and at
  the end: model, optimizer, LR schedule and step in one ``torch.save``, written to a temporary
  name, fsynced and renamed (nanolab's own atomic write), the newest ``checkpoint.keep_last``
  kept, with the files the spike guard keeps to roll back to when it is on (the same rule,
  ``kept_for_rollback``), and ``last.ckpt`` a hard link to the newest (as nanolab's files are).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from nanolab.callbacks.checkpoint_io import (
    atomic_link,
    atomic_torch_save,
    kept_for_rollback,
    step_of,
)
from nanolab.callbacks.downstream import eager_even_if_compiled
from nanolab.data.datamodule import TokenWindows


class Trained(Protocol):
    """What this module needs of the plain loop's :class:`~nanolab.bench.plain_loop.Setup`."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    micro_batch_size: int
    token_dtype: str


@dataclass(frozen=True)
class Cadence:
    """When the loop validates, scores tasks and saves: a resolved ``config.yaml``'s settings."""

    eval_every: int | None  # optimizer steps between validations; None: never
    val_windows: int
    val_batches: int | float | None  # trainer.limit_val_batches: a count, a fraction or all
    suite: str | None  # downstream.suite; None: no tasks
    tasks_every_n_evals: int
    tasks_limit: int | None
    tasks_rows: int | None
    save_every: int | None  # optimizer steps between checkpoints; None: only at the end
    keep_last: int
    rollback_window: int  # the spike guard's patience + 2 (0: guard off): see kept_for_rollback
    save_last: bool  # checkpoint.save_last: last.ckpt a link to the newest
    save_at_end: bool

    @classmethod
    def of(cls, config: dict[str, Any]) -> Cadence:
        run, data, trainer = (config.get(k) or {} for k in ("run", "data", "trainer"))
        tasks, ckpt = config.get("downstream") or {}, config.get("checkpoint") or {}
        return cls(
            eval_every=run.get("eval_every_steps"),
            val_windows=int(data.get("val_windows") or 256),
            val_batches=trainer.get("limit_val_batches"),
            suite=tasks.get("suite"),
            tasks_every_n_evals=int(tasks.get("every_n_evals") or 1),
            tasks_limit=tasks.get("limit"),
            tasks_rows=tasks.get("rows"),
            save_every=ckpt.get("every_n_steps"),
            keep_last=max(1, int(ckpt.get("keep_last") or 1)),
            rollback_window=_rollback_window(config.get("spike")),
            save_last=bool(ckpt.get("save_last", True)),
            save_at_end=bool(ckpt.get("save_on_train_end", True)),
        )


@dataclass
class Between:
    """The evaluation and checkpoint work of one plain-loop run, called after every step."""

    cadence: Cadence
    validate: Callable[[], float]
    score_tasks: Callable[[], dict[str, float]] | None
    save: Callable[[int], None]
    val_losses: list[tuple[int, float]]
    task_scores: list[tuple[int, dict[str, float]]]
    #: seconds spent in each kind of work, named as the ``end`` record's ``time_breakdown``
    seconds: dict[str, float] = field(
        default_factory=lambda: {"eval_s": 0.0, "tasks_s": 0.0, "checkpoint_s": 0.0}
    )
    validations: int = 0
    last_scored: int = 0
    last_saved: int = 0

    def after_step(self, step: int, last: bool) -> bool:
        """The work due after optimizer step ``step`` (1-based); True when there was any (the
        next step interval then holds it and is not a steady-state one)."""
        c, did = self.cadence, False
        if c.eval_every and (step % c.eval_every == 0 or last):  # fit validates its last step
            with self._timed("eval_s"):
                self.val_losses.append((step, self.validate()))
            self.validations += 1
            did = True
            if self.score_tasks and (self.validations % c.tasks_every_n_evals == 0 or last):
                self._tasks(step)
        if c.save_every and step % c.save_every == 0:
            self._save(step)
            did = True
        return did

    def at_end(self, step: int) -> None:
        """The final model is scored and saved, as ``fit`` does at the end of training."""
        if self.score_tasks and self.last_scored != step:
            self._tasks(step)
        if self.cadence.save_at_end and self.last_saved != step:
            self._save(step)

    def _tasks(self, step: int) -> None:
        assert self.score_tasks is not None
        with self._timed("tasks_s"):
            self.task_scores.append((step, self.score_tasks()))
        self.last_scored = step

    def _save(self, step: int) -> None:
        with self._timed("checkpoint_s"):
            self.save(step)
        self.last_saved = step

    @contextlib.contextmanager
    def _timed(self, kind: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[kind] += time.perf_counter() - started


def between_steps(
    config: dict[str, Any],
    setup: Trained,
    forward_context: Callable[[], contextlib.AbstractContextManager],
    device: torch.device,
    checkpoint_dir: Path,
) -> Between:
    """The validation, task scoring and saving a run of ``config`` does, on the plain loop's
    model, optimizer and schedule (``setup``). ``forward_context``: the training precision's
    autocast."""
    model, micro_batch_size = setup.model, setup.micro_batch_size
    cadence = Cadence.of(config)
    block_size = int(config["model"]["gpt"]["block_size"])
    dataset_dir = Path(config["data"]["dataset_dir"])
    val = TokenWindows(dataset_dir / "val.bin", setup.token_dtype, block_size)
    starts = val.validation_keys(cadence.val_windows)
    val_keys = [starts[i : i + micro_batch_size] for i in range(0, len(starts), micro_batch_size)]
    val_keys = val_keys[: limited(len(val_keys), cadence.val_batches)]
    if not val_keys:  # limit_val_batches 0: Lightning runs no validation at all
        cadence = replace(cadence, eval_every=None)

    def validate() -> float:
        model.eval()
        with torch.no_grad(), forward_context():
            total = torch.zeros((), device=device)
            for keys in val_keys:
                x, y = (t.to(device) for t in val[keys])
                total += model(x, y)[1].float() * len(keys)  # as Lightning weighs batches
        model.train()
        return (total / sum(len(keys) for keys in val_keys)).item()

    checkpoint_dir.mkdir(parents=True, exist_ok=True)

    def save(step: int) -> None:
        state = {
            "model": model.state_dict(),
            "optimizer": setup.optimizer.state_dict(),
            "scheduler": setup.scheduler.state_dict(),
            "step": step,
        }
        path = checkpoint_dir / f"step-{step:08d}.ckpt"
        atomic_torch_save(state, path)  # the write nanolab's checkpoints make
        if cadence.save_last:
            atomic_link(path, checkpoint_dir / "last.ckpt")
        saved = {n: p for p in checkpoint_dir.glob("step-*.ckpt") if (n := step_of(p)) is not None}
        keep = set(sorted(saved)[-cadence.keep_last :])
        if cadence.rollback_window:
            keep.update(kept_for_rollback(sorted(saved), step, cadence.rollback_window))
        for s, old in saved.items():
            if s not in keep:
                old.unlink()

    return Between(
        cadence=cadence,
        validate=validate,
        score_tasks=_task_scorer(config, model, cadence, forward_context, micro_batch_size, device),
        save=save,
        val_losses=[],
        task_scores=[],
    )


def _task_scorer(
    config: dict[str, Any],
    model: torch.nn.Module,
    cadence: Cadence,
    forward_context: Callable[[], contextlib.AbstractContextManager],
    micro_batch_size: int,
    device: torch.device,
) -> Callable[[], dict[str, float]] | None:
    """Scoring of the config's task suite, or None where ``fit`` scores none (no suite, or one
    this data's tokenizer cannot spell, which ``fit`` turns off with a warning)."""
    if cadence.suite is None:
        return None
    from nanolab.data.tokenizers import load_tokenizer
    from nanolab.downstream.scoring import evaluate_suite, suite_tokens
    from nanolab.downstream.tasks import TaskFileError, load_suite

    gpt = config["model"]["gpt"]
    suite = load_suite(cadence.suite, cadence.tasks_limit)
    tokenizer = load_tokenizer(config["data"]["dataset_dir"])
    try:
        suite_tokens(suite, tokenizer, int(gpt["block_size"]))
    except TaskFileError:
        return None

    def score() -> dict[str, float]:
        with forward_context(), eager_even_if_compiled():
            result = evaluate_suite(
                model,
                tokenizer,
                suite,
                block_size=int(gpt["block_size"]),
                rows=int(cadence.tasks_rows or micro_batch_size),
                vocab_size=int(gpt["vocab_size"]),
                device=device,
            )
        return {k: float(v) for k, v in result.record().items() if isinstance(v, int | float)}

    return score


def limited(batches: int, limit: int | float | None) -> int:
    """The validation batches Lightning runs of ``batches`` under ``trainer.limit_val_batches``
    (an int: at most that many; a float: that fraction, rounded down; None: all)."""
    if limit is None:
        return batches
    if isinstance(limit, float):
        return int(batches * limit)
    return min(batches, int(limit))


def _rollback_window(spike: Any) -> int:
    """How far back the spike guard of this config keeps a checkpoint to roll back to
    (``patience + 2``, as :class:`nanolab.callbacks.spike.SpikeGuard` asks of the checkpoint
    rotation), or 0 when the guard is off: fit keeps those files too, so the plain loop
    deletes what fit deletes."""
    spike = spike if isinstance(spike, dict) else {}
    spike = spike.get("init_args", spike)
    if not spike.get("enabled", True):
        return 0
    return int(spike.get("patience", 5)) + 2
