"""The start banner of ``nanolab fit``: one screen that says what is about to run, and for how long.

Lightning's own start-up output (accelerator lines, a model summary whose FLOPs column reads 0,
a cloud-logging tip) tells a nanolab user little; this replaces it with the figures that decide
whether a run is the one intended: model size, tokens per optimizer step and how they are made
up (micro-batch x context x accumulation x devices), precision, the run directory, where it
resumes, and a duration estimate. Everything is read from the live trainer, after the
checkpoint has been restored, so a resumed run shows its real starting step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L

from nanolab.callbacks.clock import RunClock
from nanolab.data.order import data_passes, dataset_passes, declared_pass_tokens
from nanolab.estimator.run_length import HOUR_LIMITS, hour_limits, run_length
from nanolab.model.param_sizes import parameter_numel


def _count(n: float) -> str:
    """``812_992`` -> ``813k``; ``1.24e8`` -> ``124M``."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def duration(seconds: float) -> str:
    """``185`` -> ``3m05s``; ``7300`` -> ``2h01m``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    m, s = divmod(seconds, 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def _schedule_fn(trainer: L.Trainer) -> Any | None:
    """The run's LR multiplier (a :class:`~nanolab.training.optim.WarmupCosine`, restored from
    the checkpoint when resuming), or None for a schedule of a fork's own."""
    return next(
        (f for c in getattr(trainer, "lr_scheduler_configs", None) or []
         for f in getattr(c.scheduler, "lr_lambdas", None) or [] if hasattr(f, "decay_steps")),
        None,
    )  # fmt: skip


def schedule_end(trainer: L.Trainer) -> int | None:
    """The step where the learning-rate schedule reaches its minimum (restored from the
    checkpoint when resuming: the schedule a run started with is the one it keeps)."""
    end = getattr(_schedule_fn(trainer), "decay_steps", None)
    return end if isinstance(end, int) else None


#: How a run that outlived its LR plan gets a cosine again: a resume keeps the plan.
NEW_COSINE = (
    "a resume keeps the plan: for a new cosine, train a new run (run.fresh: true, or another "
    "run.name)"
)

#: The same for a branch, whose schedule is its own model.schedule, already past its end.
BRANCH_COSINE = (
    "this branch trains with its own model.schedule: for a cosine past this step, branch with "
    "a later model.schedule.decay_steps (or null: the cosine ends at trainer.max_steps)"
)


def is_branch(pl_module: L.LightningModule) -> bool:
    """Whether this launch starts a branch (a new run from another run's checkpoint): its LR
    schedule is its own ``model.schedule``, planned for this launch's end as a new run's is
    (:mod:`nanolab.training.branch`), not the parent's plan a resume keeps."""
    return getattr(pl_module, "branched_from", None) is not None


def cosine_again(pl_module: L.LightningModule) -> str:
    """How a launch past its schedule's end gets a cosine again: :data:`NEW_COSINE`, or
    :data:`BRANCH_COSINE` for a branch (which is a new run already)."""
    return BRANCH_COSINE if is_branch(pl_module) else NEW_COSINE


@dataclass(frozen=True)
class RunEnd:
    """The step a launch trains to when nothing stops it sooner, and the setting that put it
    there: ``trainer.max_steps``, or (``max_steps`` -1) ``budget.max_tokens``.

    Attributes:
        step: The last optimizer step (:func:`nanolab.training.optim.planned_steps`).
        max_tokens: The token budget that sets it; None when ``trainer.max_steps`` does.
    """

    step: int
    max_tokens: int | None = None

    @property
    def said(self) -> str:
        """``trainer.max_steps 16``, or ``budget.max_tokens 2048 (it stops the run at step 16)``."""
        if self.max_tokens is None:
            return f"trainer.max_steps {self.step}"
        return f"budget.max_tokens {self.max_tokens} (it stops the run at step {self.step})"

    @property
    def setting(self) -> str:
        """What a new run sets to end (and plan its cosine) here."""
        if self.max_tokens is None:
            return f"trainer.max_steps {self.step}"
        return f"budget.max_tokens {self.max_tokens} (trainer.max_steps -1)"


def run_end(trainer: L.Trainer, pl_module: L.LightningModule) -> RunEnd | None:
    """Where this launch stops if nothing stops it sooner (None: neither ``trainer.max_steps``
    nor ``budget.max_tokens`` bounds it in steps). The step a new run's cosine is planned for."""
    from nanolab.training.optim import planned_steps

    step = planned_steps(trainer, pl_module)
    if step <= 0:
        return None
    if int(trainer.max_steps or -1) > 0:
        return RunEnd(step)
    # The budget, asked by what it answers (the budget's module imports this one).
    budget = next((c for c in trainer.callbacks if callable(getattr(c, "token_steps", None))), None)
    return RunEnd(step, int(budget.max_tokens) if budget and budget.max_tokens else None)


def ended_schedule_note(trainer: L.Trainer, start: int, end: int | None, horizon: int) -> str:
    """What the LR does on a resume from ``start`` to ``end`` (None: no step bounds the run)
    past the schedule's end ``horizon`` (a run extended past the steps it started with keeps
    that plan).

    Past the end the multiplier is the minimum, except inside the warm-up: a run first
    trained for fewer steps than ``warmup_steps`` keeps warming up to the warm-up's end and
    only then drops to the minimum (step ``k`` trains at the multiplier of index ``k - 1``).
    """
    fn = _schedule_fn(trainer)
    warmup = getattr(fn, "warmup_steps", None)
    ended = f"the LR schedule ended at step {horizon}"
    if fn is None or not isinstance(warmup, int) or start >= warmup:
        if end is None:
            return f"{ended}: every further step runs at its minimum"
        return f"{ended}: the extra steps run at its minimum"
    ended += f", inside its {warmup}-step warm-up"
    if end is not None and end <= warmup:
        return f"{ended}: the LR goes on rising, to {fn(end - 1):.0%} of its peak at step {end}"
    last = "every step after" if end is None else f"the last {end - warmup} steps"
    return (
        f"{ended}: the LR goes on rising to {fn(warmup - 1):.0%} of its peak at step {warmup}, "
        f"then drops to its minimum ({fn(warmup):.0%}) for {last}"
    )


def warmup_note(trainer: L.Trainer, end: RunEnd) -> str | None:
    """What a new run's warm-up does to the LR when the run never trains at its peak, or None.

    Step ``k`` trains at the multiplier of index ``k - 1``, so the LR first reaches its peak at
    step ``warmup_steps + 1``: a run that ends (``end``: ``trainer.max_steps``, or where
    ``budget.max_tokens`` stops it) at or below that never decays, however the cosine is
    planned; and a ``decay_steps`` at or before the warm-up's end drops the LR from the warm-up
    straight to the minimum. Said once at launch, not refused: a smoke test of a few steps with
    the default warm-up is meant to run, and a run an earlier release started with such a
    schedule must still resume.
    """
    fn = _schedule_fn(trainer)
    warmup = getattr(fn, "warmup_steps", None)
    decay = getattr(fn, "decay_steps", None)
    if fn is None or not isinstance(warmup, int) or not isinstance(decay, int):
        return None
    steps = end.step
    if decay <= warmup < steps:  # the run goes past the warm-up, and the next step is the minimum
        return (
            f"model.schedule.decay_steps {decay} is not above model.schedule.warmup_steps "
            f"{warmup}: the LR rises to {fn(warmup - 1):.0%} of its peak by step {warmup}, then "
            f"drops to its minimum ({fn(warmup):.0%}) and never trains at its peak; set "
            "model.schedule.decay_steps above warmup_steps, or null (the cosine ends where the "
            "run stops)"
        )
    if not never_decays(warmup, steps):
        return None  # no warm-up (the LR is at its peak from step 1), or one that ends in time
    length = "trainer.max_steps" if end.max_tokens is None else "the run's steps"
    fix = (
        f"set model.schedule.warmup_steps to at most a tenth of {length} (here {steps // 10})"
        if steps // 10 > 0
        else f"a run of {steps} steps is too short to decay: give it at least 10 steps, with "
        "model.schedule.warmup_steps at most a tenth of them"
    )
    return (
        f"model.schedule.warmup_steps {warmup} does not end before {end.said}: "
        f"the LR rises to {fn(steps - 1):.0%} of its peak at the last step and never decays; "
        f"for a warm-up then a cosine decay, {fix}"
    )


def never_decays(warmup: int, steps: int) -> bool:
    """A run of ``steps`` steps ends inside a ``warmup``-step warm-up, or at the step it first
    reaches the peak (step ``warmup + 1``): the LR never decays. No warm-up always decays."""
    return warmup > 0 and steps <= warmup + 1


@dataclass(frozen=True)
class ExpectedEnd:
    """The step a launch is expected to end at: the first of ``trainer.max_steps``, the step
    ``budget.max_tokens`` stops it at, and the step an hours, GPU-hours or cost limit stops it
    at, which is an estimate (a step time turns the hours into steps). Not the LR plan's end
    (``planned_steps``): a run of ``max_steps`` 3000 that a token budget stops at step 400
    plans its cosine for 3000 steps and ends at 400.

    Attributes:
        step: The step it ends at.
        by: The setting that ends it there (``trainer.max_steps``, ``budget.max_tokens``,
            ``budget.max_wall_hours``, ...).
        how: How a time limit's step is known (``an estimate at the measured 0.2 s/step``).
        estimated: A time limit's step: said ``~``, as the banner says it.
    """

    step: int
    by: str
    how: str = ""
    estimated: bool = False

    @property
    def shown(self) -> str:
        """``400``, or ``~400`` for an estimate."""
        return f"~{self.step}" if self.estimated else str(self.step)

    def record(self) -> dict[str, Any]:
        """The start record's ``expected_end``."""
        return {"step": self.step, "by": self.by, "estimated": self.estimated}


def token_end(trainer: L.Trainer, pl_module: L.LightningModule) -> int | None:
    """The step ``budget.max_tokens`` stops this launch at, counted from where it stands with
    what it has spent (the budget's own rule: ``CostBudget.token_steps``), or None: no token
    budget. A run of ``trainer.max_steps`` N that the budget stops sooner ends there."""
    for callback in trainer.callbacks:  # asked by what it answers (the budget imports this one)
        steps_of = getattr(callback, "token_steps", None)
        steps = steps_of(trainer, pl_module) if callable(steps_of) else None
        if steps is not None:
            return int(steps)
    return None


#: Steps the plan's step time is estimated over (the estimate's start-up left out).
PLAN_STEPS = 1000


def time_budget_end(
    trainer: L.Trainer, pl_module: L.LightningModule, tokens: int, plan: bool = True
) -> ExpectedEnd | None:
    """Where the budget's hours, GPU-hours or cost stop this launch,
    by the run-length rule fit's budget and ``nanolab queue`` use
    (:func:`nanolab.estimator.run_length.run_length`), from what the run has spent; None: no
    such limit, or no step time to turn it into steps. The step time is the one the run's
    last process measured (kept in its checkpoint: an estimate from it), else the plan's
    (the FLOPs estimate the banner's estimate line gives; ``plan`` False: none is made).
    ``tokens``: tokens per step."""
    budget = next(
        (c for c in trainer.callbacks if callable(getattr(c, "run_budget", None))), None
    )  # asked by what it answers (the budget's module imports this one)
    if budget is None or not hour_limits(limits := budget.run_budget(), 1):
        return None
    step_s = budget.measured_step_seconds()
    if step_s is not None:
        how = f"an estimate at the measured {step_s:.3g} s/step"
    else:
        planned = _safe_estimate(trainer, PLAN_STEPS, tokens) if plan else None
        if planned is None or planned[0] <= 0:
            return None
        step_s = planned[0] / PLAN_STEPS
        how = f"planned at the estimated {step_s:.3g} s/step"
    world = max(1, int(trainer.world_size or 1))
    length = run_length(None, limits, tokens, step_s, world, budget.run_spent(trainer))
    if length is None or length.source not in HOUR_LIMITS:
        return None
    return ExpectedEnd(length.steps, length.source, f"{length.source}, {how}", estimated=True)


def expected_end(
    trainer: L.Trainer, pl_module: L.LightningModule, plan: bool = True
) -> ExpectedEnd | None:
    """Where this launch ends if nothing else stops it (None: nothing bounds it in steps):
    the first of ``trainer.max_steps`` (a ``fast_dev_run``'s steps), :func:`token_end` and
    :func:`time_budget_end` (``plan`` False: only with a measured step time). What the banner's
    steps line, the progress line and the start record's ``expected_end`` say."""
    end, by = trainer.max_steps, "trainer.max_steps"
    dev_run = getattr(trainer, "fast_dev_run", False)
    if dev_run:  # Lightning counts those in micro-batches: N of them are ceil(N / accumulation)
        batches = 1 if dev_run is True else int(dev_run)
        accumulate = int(trainer.accumulate_grad_batches or 1)
        end = min(end, -(-batches // accumulate)) if end and end > 0 else -(-batches // accumulate)
    best = ExpectedEnd(int(end), by) if end is not None and end > 0 else None
    by_tokens = token_end(trainer, pl_module)
    if by_tokens is not None and (best is None or by_tokens < best.step):
        best = ExpectedEnd(by_tokens, "budget.max_tokens")
    per_step = tokens_per_step(trainer, pl_module)
    timed = time_budget_end(trainer, pl_module, per_step[0], plan) if per_step else None
    if timed is not None and (best is None or timed.step < best.step):
        best = timed
    return best


def budget_planned_steps(trainer: L.Trainer, pl_module: L.LightningModule) -> int | None:
    """Where the cosine of a run without ``trainer.max_steps`` ends when ``budget.max_tokens``
    planned it (:func:`nanolab.training.optim.planned_steps`), or None."""
    from nanolab.training.optim import planned_steps

    schedule = getattr(pl_module, "schedule_config", None)
    end = schedule_end(trainer)
    if getattr(schedule, "decay_steps", 0) is not None or end is None:
        return None  # a horizon set on purpose, or a schedule of a fork's own
    return end if end == planned_steps(trainer, pl_module) else None


def planned_course(trainer: L.Trainer, planned: int) -> str:
    """What the LR of a run whose cosine ``budget.max_tokens`` planned does by step
    ``planned``: its cosine ends there, or it never leaves the warm-up (said as it is, not as
    a cosine that ends)."""
    warmup = getattr(_schedule_fn(trainer), "warmup_steps", None)
    if isinstance(warmup, int) and never_decays(warmup, planned):
        return (
            f"budget.max_tokens stops it at step {planned}, inside the LR's {warmup}-step "
            "warm-up: the LR never decays"
        )
    return f"the LR cosine ends at step {planned} (budget.max_tokens)"


def unplanned_note(trainer: L.Trainer, pl_module: L.LightningModule) -> str | None:
    """The launch warning of a new run whose LR cosine has no end to plan for (``trainer.
    max_steps`` -1, no token budget, no ``decay_steps``), or None."""
    from nanolab.training.optim import ScheduleConfig, planned_steps, unplanned_schedule_note

    schedule = getattr(pl_module, "schedule_config", None)
    if not isinstance(schedule, ScheduleConfig) or _schedule_fn(trainer) is None:
        return None
    return unplanned_schedule_note(schedule, planned_steps(trainer, pl_module))


def resumed_schedule_note(
    trainer: L.Trainer, pl_module: L.LightningModule, start: int, end: RunEnd | None
) -> str | None:
    """What a resume to another end does to the LR, or None.

    The cosine of ``model.schedule.decay_steps: null`` is planned for the steps a run started
    with (``trainer.max_steps``, or where ``budget.max_tokens`` stopped it), and the checkpoint
    keeps that plan (an exact resume). A resume whose end (``end``; None: nothing bounds it in
    steps now) moves inside the plan stops before the LR anneals, or runs its last steps at the
    minimum: said once, with the LR it stops at (step ``end`` trains at the multiplier of index
    ``end - 1``), so a shortened run is not read as annealed, nor a longer one as decaying.
    """
    schedule = getattr(pl_module, "schedule_config", None)
    if start <= 0 or getattr(schedule, "decay_steps", 0) is not None:
        return None  # a new run, or a horizon set on purpose (model.schedule.decay_steps)
    fn = _schedule_fn(trainer)
    horizon = getattr(fn, "decay_steps", None)
    if fn is None or not isinstance(horizon, int) or start >= horizon:
        return None  # already past the plan's end: the banner's steps line says so
    if end is not None and end.step == horizon:
        return None  # the plan's own end
    planned = "this run's LR schedule was planned for (a resume keeps the plan)"
    new_run = "train a new run (run.fresh: true, or another run.name) with"
    if end is None:
        return (
            f"no trainer.max_steps or budget.max_tokens bounds the run in steps now, so it "
            f"trains past the {horizon} steps {planned}: the LR reaches its minimum at step "
            f"{horizon} "
            f"and every step after runs there; for a cosine to a later end, {new_run} the "
            "trainer.max_steps or budget.max_tokens it should end at"
        )
    if end.step < horizon:
        return (
            f"{end.said} is short of the {horizon} steps {planned}: it stops at step "
            f"{end.step} with the LR at {fn(end.step - 1):.0%} of its peak, before the cosine "
            f"reaches its minimum at step {horizon}; to anneal by step {end.step}, {new_run} "
            f"{end.setting}"
        )
    return (
        f"{end.said} is past the {horizon} steps {planned}: the LR reaches its minimum at step "
        f"{horizon} and the last {end.step - horizon} steps run there; to anneal over all "
        f"{end.step} steps, {new_run} {end.setting}"
    )


def launch_schedule_note(
    trainer: L.Trainer, pl_module: L.LightningModule, resuming: bool
) -> str | None:
    """The one warning a launch gives about its LR schedule, or None: a resume that moves the
    end off the checkpoint's plan, a new run that never trains at its peak, or a new run whose
    cosine has no end to plan for. The same rule whether ``trainer.max_steps`` or
    ``budget.max_tokens`` sets the end. A branch's schedule is planned as a new run's (its own
    ``model.schedule`` for this launch's end): its notes are a new run's."""
    end = run_end(trainer, pl_module)
    if resuming and not is_branch(pl_module):
        return resumed_schedule_note(trainer, pl_module, int(trainer.global_step), end)
    if end is not None:
        return warmup_note(trainer, end)
    return unplanned_note(trainer, pl_module)


def tokens_per_step(trainer: L.Trainer, pl_module: L.LightningModule) -> tuple[int, str] | None:
    """Tokens per optimizer step and the product that makes it up."""
    dm = getattr(trainer, "datamodule", None)
    micro = getattr(dm, "micro_batch_size", None)
    gpt = getattr(pl_module, "gpt_config", None)
    block = getattr(gpt, "block_size", None)
    if not isinstance(micro, int) or not isinstance(block, int):
        return None
    accumulate = int(trainer.accumulate_grad_batches or 1)
    world = int(trainer.world_size or 1)
    total = micro * block * accumulate * world
    how = (
        f"{micro} micro-batch x {block} context x {accumulate} accumulation x {world} "
        f"device{'s' if world > 1 else ''}"
    )
    return total, how


def estimate_seconds(trainer: L.Trainer, steps: int, tokens: int) -> tuple[float, str] | None:
    """Seconds for ``steps`` more steps, with the estimate ``nanolab queue`` makes for a job (past
    runs are not consulted here): the FLOPs over this device's rate at an assumed efficiency."""
    from nanolab.estimator.runtime import STARTUP_S, run_seconds
    from nanolab.training.resolve import load_yaml

    saved = Path(trainer.default_root_dir) / "config.yaml"
    if steps <= 0 or not saved.is_file():
        return None
    config = load_yaml(saved.read_text(encoding="utf-8"))  # read as every config is read
    if not isinstance(config, dict):
        return None
    seconds, how = run_seconds(
        config,
        devices=max(1, int(trainer.num_devices or 1)),
        tokens_per_step=tokens,
        max_steps=steps,
    )
    if seconds is None:
        return None
    return max(0.0, seconds - STARTUP_S), str(how)


def repeat_note(trainer: L.Trainer, steps_ahead: int, tokens: int) -> str | None:
    """``the data repeats: ...`` when the order, where it stands ``steps_ahead`` steps on (a
    fork's own loader: ``tokens`` trained by then), has served some data more than once, else
    None. A mixture's ``epoch`` counts all its datasets' windows together, so the dataset
    repeated most is said, with its own passes: one of few windows and a large share repeats
    long before that epoch reaches 1."""
    mixture = dataset_passes(trainer, steps_ahead)
    if mixture:
        most = max(mixture, key=lambda d: d.passes)
        if most.passes <= 1:
            return None
        return (
            f"the data repeats: {most.passes:.3g} passes over {most.name}'s "
            f"{_count(most.pass_tokens)} training tokens (the mixture's most repeated dataset)"
        )
    passes = data_passes(trainer, steps_ahead, tokens)
    if passes is None or passes <= 1:
        return None
    split = _count(declared_pass_tokens(getattr(trainer, "datamodule", None)) or 0)
    return f"the data repeats: {passes:.3g} passes over its {split} training tokens"


def banner_lines(
    trainer: L.Trainer, pl_module: L.LightningModule, estimate: bool = True
) -> list[str]:
    """The banner, one line per fact; a fact that cannot be read is left out, never guessed."""
    lines = [f"nanolab fit: {trainer.default_root_dir}"]
    gpt = getattr(pl_module, "gpt_config", None)
    params = sum(parameter_numel(p) for p in pl_module.parameters())
    if gpt is not None:
        lines.append(
            f"  model      {_count(params)} parameters: {_plural(gpt.n_layer, 'layer')} x {gpt.n_embd} wide, "
            f"{_plural(gpt.n_head, 'head')}, context {gpt.block_size}, vocabulary {gpt.vocab_size}"
        )
    else:
        lines.append(f"  model      {_count(params)} parameters")
    per_step = tokens_per_step(trainer, pl_module)
    if per_step is not None:
        lines.append(f"  batch      {per_step[0]:,} tokens/step = {per_step[1]}")
    device = trainer.strategy.root_device.type
    strategy = type(trainer.strategy).__name__.replace("Strategy", "") or "single device"
    nodes = f" x {trainer.num_nodes} nodes" if trainer.num_nodes > 1 else ""
    lines.append(
        f"  devices    {trainer.num_devices} {device}{nodes} ({strategy}), precision {trainer.precision}"
    )
    start = trainer.global_step
    ckpt = getattr(trainer, "ckpt_path", None)
    if ckpt and start > 0:
        lines.append(f"  resume     from step {start} ({ckpt})")
    else:
        lines.append("  resume     none: a new run from step 0")
    expected = expected_end(trainer, pl_module, estimate)
    # A run of max_steps -1 that only a token budget bounds: said with its LR plan, below.
    unbounded = int(trainer.max_steps or -1) <= 0 and not getattr(trainer, "fast_dev_run", False)
    if expected is not None and not (unbounded and expected.by == "budget.max_tokens"):
        horizon = schedule_end(trainer)
        end = expected.step
        stopped_by = (
            "" if expected.by == "trainer.max_steps" else f" ({expected.how or expected.by})"
        )
        steps = f"  steps      {start} -> {expected.shown}{stopped_by}"
        if per_step is not None:
            steps += f" ({_count((end - start) * per_step[0])} tokens to go)"
            callbacks = getattr(trainer, "callbacks", ())
            clock = next((c for c in callbacks if isinstance(c, RunClock)), None)
            so_far = clock.run_tokens if clock is not None else start * per_step[0]
            repeats = repeat_note(trainer, end - start, so_far + (end - start) * per_step[0])
            if repeats is not None:
                steps += f"; {repeats}"
        if horizon is not None and start >= horizon and end > horizon:
            steps += f"; {ended_schedule_note(trainer, start, end, horizon)}; "
            steps += cosine_again(pl_module)
        lines.append(steps)
        if estimate and per_step is not None:
            guess = _safe_estimate(trainer, end - start, per_step[0])
            if guess is not None:
                seconds, how = guess
                text = f"  estimate   ~{duration(seconds)} of training ({how})"
                price = _price(trainer)
                if price:
                    hours = seconds / 3600 * trainer.num_devices * trainer.num_nodes
                    text += f", ~{hours * price[0]:.2f} {price[1]}"
                lines.append(text)
    else:
        steps = f"  steps      from {start}, no max_steps: a budget or a signal stops it"
        planned = budget_planned_steps(trainer, pl_module)
        horizon = schedule_end(trainer)
        if ckpt and horizon is not None and 0 < horizon <= start:  # resumed past its plan
            bound = run_end(trainer, pl_module)
            ended = ended_schedule_note(trainer, start, bound.step if bound else None, horizon)
            steps += f"; {ended}; {cosine_again(pl_module)}"
        elif planned is not None:
            steps += f"; {planned_course(trainer, planned)}"
        lines.append(steps)
    for callback in trainer.callbacks:  # callbacks that say what they add to the run's time
        line = getattr(callback, "banner_line", None)
        text = line(lambda tokens: _forward_seconds(trainer, tokens, estimate)) if line else None
        if text:
            lines.append(text)
    return lines


#: A forward-only pass over N tokens, as a fraction of a training step's time over N tokens.
#: Its FLOPs are a third (forward 2 per parameter, backward 4), but scoring runs at lower
#: efficiency (rows of mixed length, short unconditional rows): the quickstart's cloze (0.14M
#: tokens) took 1.9-2.2 s per evaluation where the banner's training rate gives 4.2 s for as
#: many training tokens (2-core CPU, 2026-12-02, four evaluations), so one half.
FORWARD_TIME_FRACTION = 1 / 2


def _forward_seconds(trainer: L.Trainer, tokens: int, estimate: bool) -> float | None:
    """Seconds for forward passes over ``tokens`` tokens at the banner's training rate."""
    guess = _safe_estimate(trainer, 1, tokens) if estimate and tokens > 0 else None
    return None if guess is None else guess[0] * FORWARD_TIME_FRACTION


def _safe_estimate(trainer: L.Trainer, steps: int, tokens: int) -> tuple[float, str] | None:
    try:
        return estimate_seconds(trainer, steps, tokens)
    except Exception:  # an estimate is a courtesy: it must never stop a run
        return None


def _price(trainer: L.Trainer) -> tuple[float, str] | None:
    for cb in trainer.callbacks:
        price = getattr(cb, "price_per_gpu_hour", None)
        if isinstance(price, (int, float)) and price > 0:
            return float(price), str(getattr(cb, "currency", ""))
    return None


def print_banner(trainer: L.Trainer, pl_module: L.LightningModule, **kwargs: Any) -> None:
    if trainer.is_global_zero:
        print("\n".join(banner_lines(trainer, pl_module, **kwargs)), flush=True)


def _plural(n: int, noun: str) -> str:
    """``1 layer``, ``4 layers``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
