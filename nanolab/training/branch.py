"""A branch: a new run started from another run's checkpoint, with settings of its own.

A resume of the run itself is exact: the optimizer's state and the LR schedule come back from
the checkpoint, hyperparameters included, so a changed ``model.optimizer.lr`` cannot take effect
there. A branch is how a run is continued with other settings (the documented fix for a diverged
run: a lower learning rate from its newest finite checkpoint). Lightning restores the
optimizer's ``param_groups`` (``lr``, ``initial_lr``, betas, ...) and the scheduler's
``base_lrs`` and schedule function from the checkpoint after ``configure_optimizers`` built them
from the branch's config, so the branch's values would be lost: :class:`BranchLR` keeps them as
built (:func:`built_settings`) and puts them back once the state is restored
(:func:`take_branch_settings`). The optimizer's moments and step counts stay the parent's.

A branch's cosine planned by its budget (``trainer.max_steps: -1`` with ``budget.max_tokens``)
ends where that budget stops it, counted from the parent's step: the plan can only be made once
that step is restored, after ``configure_optimizers`` ran (at step 0, it ended a budget's worth
of steps after step 0, long before the branch's first step, which then trained at the minimum
LR throughout), so :class:`BranchLR` plans its schedule again then (``replan``).

Also the one command that starts such a branch (:func:`branch_command`), which the resume
warning and the divergence stop both name.
"""

from __future__ import annotations

import copy
import shlex
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

#: The parameter-group settings a branch takes from its own optimizer as built, beside the
#: learning rate (``initial_lr``, the schedule's peak): the ``model.optimizer`` values the
#: registered optimizers put in their groups (Muon's groups name ``muon_lr``,
#: ``muon_momentum`` and ``muon_weight_decay`` ``initial_lr``, ``momentum`` and
#: ``weight_decay``). Kernel choices (``fused``, ``foreach``) are not among them: the restored
#: state's tensors are placed for the parent's kernel.
#: ``model.optimizer`` keys a branch keeps from its parent (``name`` is refused when it differs:
#: another optimizer's state would not fit): the kernel, for which the restored state's step
#: counts were placed (on the device for a fused AdamW, on the host otherwise).
BRANCH_KEEPS = ("fused",)

GROUP_SETTINGS = ("initial_lr", "weight_decay", "betas", "eps", "momentum")


@dataclass(frozen=True)
class BuiltSettings:
    """What ``configure_optimizers`` built from the config: each parameter group's
    :data:`GROUP_SETTINGS` and each group's schedule function (copies: the restore updates
    the live schedule functions in place)."""

    groups: list[dict[str, Any]]
    schedules: list[Any]


def built_settings(optimizer: Any, scheduler: Any) -> BuiltSettings:
    """The settings of a freshly built optimizer and its ``LambdaLR`` scheduler, before any
    checkpoint is restored into them."""
    groups = [
        {key: copy.deepcopy(group[key]) for key in GROUP_SETTINGS if key in group}
        for group in optimizer.param_groups
    ]
    return BuiltSettings(groups, [copy.deepcopy(fn) for fn in scheduler.lr_lambdas])


def take_branch_settings(optimizer: Any, scheduler: Any, built: BuiltSettings) -> list[float]:
    """After the checkpoint's optimizer and scheduler state were restored: give every parameter
    group the branch's settings and the scheduler the branch's peak rates and schedule, at the
    restored step, and return the rates the next step trains with. The per-parameter state
    (Adam's moments, step counts) is left as restored."""
    groups = optimizer.param_groups
    if len(groups) != len(built.groups):  # another layout of groups: nothing is guessed
        raise ValueError(
            f"the branch's optimizer has {len(built.groups)} parameter groups, the restored "
            f"one {len(groups)}"
        )
    for group, settings in zip(groups, built.groups, strict=True):
        group.update(copy.deepcopy(settings))
    scheduler.base_lrs = [group["initial_lr"] for group in groups]
    scheduler.lr_lambdas = [copy.deepcopy(fn) for fn in built.schedules]
    rates = [
        base * fn(scheduler.last_epoch)
        for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
    ]
    for group, rate in zip(groups, rates, strict=True):
        group["lr"] = rate
    scheduler._last_lr = list(rates)  # what get_last_lr() answers (the spike guard reads it)
    return rates


class BranchLR(torch.optim.lr_scheduler.LambdaLR):
    """The LR schedule of a branch: a ``LambdaLR`` that keeps the settings its optimizer and it
    were built with, and takes them back right after the parent's state is loaded into it.

    Lightning loads the optimizers' state, then the schedulers' (``load_state_dict`` of
    this class), both before any hook of the training loop, so every reader from the first
    hook on (the banner's schedule note, the run log's rates, the spike guard) sees the
    branch's values. The saved state is an ordinary ``LambdaLR``'s: a resume of the branch
    itself is exact.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lr_lambda: Any,
        replan: Callable[[], Any] | None = None,
    ) -> None:
        """``replan``: the branch's schedule function planned from where it stands, asked once
        the parent's step is restored (the trainer's ``global_step`` is restored before the
        schedulers' state): the end its budget stops it at depends on that step."""
        super().__init__(optimizer, lr_lambda)
        self.branch_settings = built_settings(optimizer, self)
        self.replan = replan

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if self.replan is not None:
            schedule = self.replan()
            self.branch_settings = replace(
                self.branch_settings,
                schedules=[copy.deepcopy(schedule) for _ in self.branch_settings.schedules],
            )
        take_branch_settings(self.optimizer, self, self.branch_settings)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.pop("branch_settings", None)  # the built values are this launch's, not state
        state.pop("replan", None)
        return state


def branch_name(run_name: str, changes: dict[str, Any]) -> str:
    """A name for a branch of ``run_name`` that says what it changes (``dv-lr0.0001``)."""
    lr = changes.get("model.optimizer.lr")
    return f"{run_name}-lr{lr}" if lr is not None else f"{run_name}-branch"


def branch_command(
    run_dir: str | Path, run_name: str, checkpoint: str | Path | None, changes: dict[str, Any]
) -> str:
    """The command that starts a branch of the run in ``run_dir`` from ``checkpoint`` with
    ``changes`` (dotted key -> value as typed on the command line): the run's own
    ``config.yaml`` (the run as it ran), another ``run.name``, the checkpoint, the changes.
    ``checkpoint`` None: a new run of the same config, from step 0."""
    args = [
        "nanolab",
        "fit",
        "--config",
        str(Path(run_dir) / "config.yaml"),
        "--run.name",
        branch_name(run_name, changes),
    ]
    if checkpoint is not None:
        args += ["--run.resume", str(checkpoint)]
    for key, value in changes.items():
        args += [f"--{key}", str(value)]
    return shlex.join(args)


def lower_rate(lr: float) -> str:
    """A tenth of ``lr``, as a short number (``0.0003``, ``1e+35``)."""
    return f"{lr / 10:g}"
