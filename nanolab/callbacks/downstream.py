"""In-context task accuracies during ``fit``, at the validation cadence (docs/evaluate.md).

``--downstream.suite builtin:shakespeare`` (or a YAML suite, or a DCLM bundle folder for CORE)
scores the model on the suite after every ``every_n_evals``-th validation and writes a
``tasks`` record to the run log at that step: per task ``tasks/<name>/acc``, ``acc_norm``,
``centered`` and ``n``, and ``tasks/core``. The loggers get the same numbers on the same step
axis; ``nanolab report`` shows them; ``nanolab eval`` on the checkpoint of that step gives
exactly the same numbers (same tokenizer, same prompts, same scoring).

Safe to leave on overnight:

* the task files are read and every example tokenized with the data's tokenizer in ``setup``:
  a bad file stops the run before its first step (exit 2), not at 3 a.m.; a suite this data's
  vocabulary cannot spell (a character tokenizer of other text) is turned off with one warning
  and the run goes on;
* a batch is ``rows`` sequences (the training micro-batch unless set) of at most the block
  size, scored without gradients: never more memory than the training step that already ran;
* the time is known: the banner gives the predicted seconds per evaluation, and the time is a
  pause of its own (``tasks_s`` in the run log's time breakdown, outside goodput's step time);
* on several devices the examples are sharded round-robin, every rank runs the same number of
  forward passes (sharded models need that) and the counts are summed: the numbers are the
  same on 1 or N devices.
"""

from __future__ import annotations

import contextlib
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from nanolab.callbacks.clock import RunClock
from nanolab.callbacks.events import CallbackConfigError, emit, stop_reason
from nanolab.callbacks.step import scheduled_validation
from nanolab.training.callback_settings import check_downstream


class DownstreamEval(Callback):
    """Score the model on a task suite every ``every_n_evals`` validations of ``fit``.

    Args:
        suite: ``builtin:<name>``, a YAML list of tasks, or a DCLM evaluation bundle folder;
            ``null`` = off.
        every_n_evals: Run after every N-th validation (1 = each one). The last validation of
            the run is always followed by one, so the final model is always scored.
        limit: At most this many examples per task (the first ones after CORE's seeded
            shuffle), to bound the time; ``null`` = all.
        rows: Sequences per forward pass; ``null`` = the training micro-batch (so an
            evaluation never needs more memory than a training step).
    """

    def __init__(
        self,
        suite: str | None = None,
        every_n_evals: int = 1,
        limit: int | None = None,
        rows: int | None = None,
    ) -> None:
        check_downstream({"every_n_evals": every_n_evals, "limit": limit, "rows": rows})
        self.suite_spec, self.every_n_evals = suite, every_n_evals
        self.limit, self.rows = limit, rows
        self.suite: Any = None
        self.tokenizer: Any = None
        self.tokens_per_eval = 0
        self._validations = 0
        self.last_step: int | None = None

    @property
    def active(self) -> bool:
        return self.suite_spec is not None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not self.active or stage != "fit":
            return
        from nanolab.data.tokenizers import data_tokenizer
        from nanolab.downstream.scoring import suite_tokens
        from nanolab.downstream.tasks import TaskFileError, load_suite

        if getattr(pl_module, "gpt_config", None) is None:
            raise CallbackConfigError(
                "downstream.suite scores nanolab's GPT (a module with gpt_config); this model has "
                "none: set downstream.suite null, or run nanolab eval on its checkpoints"
            )
        self.suite = load_suite(self.suite_spec, self.limit)
        dataset_dir = getattr(trainer.datamodule, "dataset_dir", None)
        if dataset_dir is None:
            raise CallbackConfigError(
                "downstream.suite needs the data's tokenizer, and this DataModule has no "
                "dataset_dir; set downstream.suite null"
            )
        self.tokenizer = data_tokenizer(trainer.datamodule)  # the one the checkpoint stores
        try:
            self.tokens_per_eval = suite_tokens(self.suite, self.tokenizer, self._block(pl_module))
        except TaskFileError as err:
            # The file is fine; this data's vocabulary cannot spell it (the quickstart's cloze
            # on a character vocabulary of other text). The run goes on, without the tasks.
            rank_zero_warn(
                f"downstream.suite {self.suite_spec} is off for this run: {err}; set "
                "downstream.suite to tasks this data's tokenizer can encode, or null"
            )
            self.suite_spec, self.suite = None, None
            return
        micro = int(getattr(trainer.datamodule, "micro_batch_size", 0) or 0)
        if self.rows is None:
            self.rows = micro or 8
        elif micro and self.rows > micro:
            raise CallbackConfigError(
                f"downstream.rows {self.rows} is more than the training micro-batch ({micro}): "
                "an evaluation batch could then need more memory than a training step; leave "
                "it null (= the micro-batch) or lower it"
            )
        RunClock.attach(trainer)

    @staticmethod
    def _block(pl_module: L.LightningModule) -> int:
        return int(pl_module.gpt_config.block_size)  # type: ignore[attr-defined]

    def examples(self) -> int:
        return sum(len(t.examples) for t in self.suite.tasks) if self.suite is not None else 0

    def banner_line(self, forward_seconds: Any) -> str | None:
        """The start banner's line: what is scored, how often, and the time of one evaluation
        (``forward_seconds(tokens)`` is the banner's estimate for a forward pass over them)."""
        if not self.active or self.suite is None:
            return None
        every = (
            "each validation"
            if self.every_n_evals == 1
            else f"every {self.every_n_evals} validations"
        )
        text = (
            f"  tasks      {self.suite_spec}: {len(self.suite.tasks)} task(s), {self.examples():,} "
            f"examples ({self.tokens_per_eval / 1e6:.2f}M tokens) after {every}"
        )
        seconds = forward_seconds(self.tokens_per_eval)
        if seconds is not None:
            from nanolab.callbacks.banner import duration

            text += f", ~{duration(seconds)} each"
        return text

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.active or trainer.sanity_checking or trainer.state.fn != "fit":
            return
        scheduled = scheduled_validation(trainer)  # a stop's extra one moves no schedule
        self._validations += int(scheduled)
        last = 0 < (trainer.max_steps or -1) <= trainer.global_step  # -1: a budget ends the run
        if (not scheduled or self._validations % self.every_n_evals) and not last:
            return  # a stopped run's final model is scored at on_train_end
        self.run(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The final model is scored even when the last step was not a validation step (not
        when the run was preempted, diverged or rolled back: then it must stop now, or has
        nothing to score)."""
        reason, _ = stop_reason(trainer)
        if reason in ("preempted", "diverged", "rollback", "error") or trainer.global_step == 0:
            return
        if self.active and self.last_step != trainer.global_step:
            self.run(trainer, pl_module)

    def run(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Score the suite now and write the ``tasks`` record (every rank takes part)."""
        from nanolab.downstream.scoring import evaluate_suite

        if self.last_step == trainer.global_step:
            return
        model = getattr(pl_module, "model", pl_module)
        clock = RunClock.attach(trainer)
        clock.sync_device(trainer)
        # Eager even when the model is compiled: scoring runs prompts of every length through
        # the KV-cache path, and compiling each shape cost 23 recompiles and 215 s against
        # 1.6 s eager (quickstart size, CPU). Training's compiled graphs are kept as they are.
        with (
            clock.pause("tasks"),
            trainer.strategy.precision_plugin.forward_context(),
            eager_even_if_compiled(),
        ):
            result = evaluate_suite(
                model,
                self.tokenizer,
                self.suite,
                block_size=self._block(pl_module),
                rows=int(self.rows or 1),
                vocab_size=int(pl_module.gpt_config.vocab_size),  # type: ignore[attr-defined]
                device=pl_module.device,
                rank=trainer.global_rank,
                world_size=trainer.world_size,
                all_reduce=lambda t: trainer.strategy.reduce(t, reduce_op="sum"),
                equal_batches=lambda n: _max_over_ranks(trainer, n),
            )
        self.last_step = trainer.global_step
        record = {"event": "tasks", "step": int(trainer.global_step), "suite": self.suite_spec}
        record.update(result.record())
        emit(trainer, record)
        if trainer.is_global_zero:
            rank_zero_info(
                f"tasks step {trainer.global_step}: "
                + ", ".join(f"{t.name} {t.score:.3f}" for t in result.tasks)
                + f" ({result.label} {result.core:+.3f}, 0 = chance; {result.seconds:.1f}s)"
            )

    def state_dict(self) -> dict[str, Any]:
        return {"validations": self._validations}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._validations = int(state_dict.get("validations", 0))


def _max_over_ranks(trainer: L.Trainer, n: int) -> int:
    """The largest ``n`` of all ranks (every rank must run as many forward passes)."""
    if trainer.world_size <= 1:
        return n
    value = torch.tensor([float(n)], device=trainer.strategy.root_device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return round(float(value.item()))


def eager_even_if_compiled() -> contextlib.AbstractContextManager:
    """Run compiled modules eagerly inside the block (torch >= 2.6); a no-op before that."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()
