"""Where a resumed run continues in the training order, whatever the launch's batch layout.

The order (:mod:`nanolab.data.windows`) is counted in micro-batch *positions*: position ``g``
is the ``g``-th group of ``micro_batch_size x world_size`` windows of the order (the layout's
*unit*). A position therefore names other windows once the micro-batch or the device count
changes, and a resume that restarted at "optimizer steps x accumulation" in the new unit
skipped or repeated windows. So a checkpoint records the position its next micro-batch starts
at, with the unit it is counted in (:func:`order_record`), and a resume carries it into its own
unit (:func:`carry`): the same window of the same epoch, or, when that is not the start of a
whole micro-batch of the new layout, the next whole one, with one line saying how many windows
that skips. A rollback's jump (:mod:`nanolab.data.skips`) is carried the same way: its ledger
entry records the unit it was counted in and where the order stood at the checkpoint it
restored, so a resume from an older checkpoint jumps when it reaches that window, whatever step
number that is in its own layout; where the place it jumps to is not the start of a whole
micro-batch of the new layout, it goes on at the next whole one and says so in the same line.

A checkpoint saved before the record gives its position as resumes always took it: its
optimizer steps x the accumulation of the layout that saved it, in that layout's unit, with the
run's jumps. On an unchanged layout that is exactly the position such a resume always took.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from nanolab.data.skips import Jump, data_position, jumps, read_ledger

#: The key of the record in the checkpoint's ``nanolab`` section.
ORDER_KEY = "order"


@dataclass(frozen=True)
class SavedOrder:
    """What a checkpoint says about its place in the training order.

    ``position`` is where its next micro-batch starts, in micro-batches of ``unit`` windows;
    ``None`` for a checkpoint saved before that record, whose position is derived from its
    ``step`` and the ``accumulate`` of the layout that saved it (``None``: not recorded either).
    """

    step: int
    position: int | None
    unit: int | None
    accumulate: int | None


@dataclass(frozen=True)
class Carried:
    """A position carried into another layout's micro-batches.

    ``position``: in the new layout's micro-batches. ``skipped``: windows of the order passed
    over to start on a whole micro-batch (0 when it starts exactly there). ``epoch`` and
    ``window``: where the old position was (the epoch, or ``None`` for an order without epochs,
    a mixture's, and the windows of it before the old position); ``next_epoch``: the rest of
    that epoch held no whole micro-batch of the new layout, so it starts the next one.
    """

    position: int
    skipped: int = 0
    epoch: int | None = None
    window: int = 0
    next_epoch: bool = False


def unit_of(plan: Any) -> int | None:
    """Windows per micro-batch position of ``plan`` (micro-batch x devices); ``None`` for a plan
    that does not say (a fork's own), whose positions are then taken as they are."""
    micro, world = getattr(plan, "micro_batch_size", None), getattr(plan, "world_size", None)
    if not isinstance(micro, int) or not isinstance(world, int) or micro < 1 or world < 1:
        return None
    return micro * world


def carry(plan: Any, position: int, unit: int | None) -> Carried:
    """Position ``position`` of a layout of ``unit`` windows per micro-batch, as a position of
    ``plan``: the first micro-batch of ``plan`` that starts at or after the same window.

    An order with epochs (:class:`~nanolab.data.windows.WindowPlan`, ``IndexPlan``) drops the
    windows that do not fill a whole micro-batch at each epoch's end, so the same position
    falls in the same epoch only when counted per epoch; a mixture's order has no epochs.
    """
    now = unit_of(plan)
    if unit is None or now is None or unit == now:
        return Carried(position)
    windows = getattr(plan, "num_windows", None)
    per_epoch = getattr(plan, "batches_per_epoch", None)
    if not isinstance(windows, int) or not isinstance(per_epoch, int):
        window = position * unit  # one endless order (a mixture's slots)
        start = -(-window // now)
        return Carried(start, start * now - window, None, window)
    epoch, within = divmod(position, max(1, windows // unit))
    window = within * unit
    start = -(-window // now)
    if start >= per_epoch:  # the rest of the epoch is less than a micro-batch of the new layout
        return Carried((epoch + 1) * per_epoch, windows - window, epoch, window, True)
    return Carried(epoch * per_epoch + start, start * now - window, epoch, window)


def saved_order(checkpoint: dict[str, Any]) -> SavedOrder:
    """The :class:`SavedOrder` of a checkpoint (its ``nanolab`` section and global step)."""
    section = checkpoint.get("nanolab")
    section = section if isinstance(section, dict) else {}
    step = checkpoint.get("global_step")
    step = step if isinstance(step, int) else 0
    record = section.get(ORDER_KEY)
    if isinstance(record, dict) and _count(record.get("position"), 0) is not None:
        unit = _count(record.get("unit"), 1)
        if unit is not None:
            return SavedOrder(step, int(record["position"]), unit, None)
    layout = section.get("layout")
    if isinstance(layout, dict):
        world, micro = (
            _count(layout.get("world_size"), 1),
            _count(layout.get("micro_batch_size"), 1),
        )
        unit = world * micro if world is not None and micro is not None else None
        return SavedOrder(step, None, unit, _count(layout.get("accumulate"), 1))
    return SavedOrder(step, None, None, None)


def _count(value: Any, least: int) -> int | None:
    """``value`` when it is an int (not a bool) of at least ``least``."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= least
    return value if ok else None


def order_record(trainer: Any) -> dict[str, int] | None:
    """What a checkpoint saved now records: the position the micro-batch after this optimizer
    step starts at, and the unit it is counted in. ``None`` without nanolab's sampler (a fork's
    loader, or no training loader yet)."""
    place = order_position(trainer)
    if place is None:
        return None
    plan, position = place
    unit = unit_of(plan)
    return None if unit is None else {"position": position, "unit": unit}


def order_position(trainer: Any, steps_ahead: int = 0) -> tuple[Any, int] | None:
    """(plan, position) of nanolab's training sampler: the micro-batch position the step
    ``steps_ahead`` optimizer steps after this one starts at (0: the next step's), counted as
    the sampler counts (a branch's from its parent's step, rollbacks' jumps included). ``None``
    without nanolab's sampler (a fork's loader, or no training loader yet)."""
    from nanolab.data.windows import ResumableBatchSampler

    sampler = getattr(getattr(trainer, "datamodule", None), "train_sampler", None)
    if not isinstance(sampler, ResumableBatchSampler):
        return None
    accumulate = int(trainer.accumulate_grad_batches or 1)
    consumed = (int(trainer.global_step) + steps_ahead) * accumulate
    return sampler.plan, sampler.position(consumed)


def data_passes(trainer: Any, steps_ahead: int = 0, tokens: int | None = None) -> float | None:
    """Passes over the training data the order has served by :func:`order_position` (1.5:
    halfway through the second), a run's ``epoch``: the sampler's position in windows over the
    windows one pass serves (``windows_per_pass``: an epoch's whole micro-batches; the tokens
    no window holds, those document packing crops, are no part of a pass). It follows the
    data, so a branch, whose order goes on from its parent's position, goes on from its
    parent's epoch; on other data than its parent's (``data.allow_changed``, a fine-tune) it
    counts passes over that data, from the place it began at (the data module's
    ``pass_origin``, in windows; kept in its checkpoints).

    Without nanolab's sampler (a fork's data module with a training loader of its own) there is
    no order to ask: ``tokens``, the tokens the run has trained on by then, over the tokens one
    pass holds as the data module says (:func:`declared_pass_tokens`). ``None`` when neither
    the sampler nor the data module says."""
    place = order_position(trainer, steps_ahead)
    if place is None:
        per_pass = declared_pass_tokens(getattr(trainer, "datamodule", None))
        return None if per_pass is None or tokens is None else round(tokens / per_pass, 4)
    plan, position = place
    windows, unit = getattr(plan, "windows_per_pass", None), unit_of(plan)
    if not isinstance(windows, int) or windows < 1 or unit is None:
        return None
    return round(max(0, position * unit - pass_origin(trainer)) / windows, 4)


def pass_origin(trainer: Any) -> int:
    """The window of the order this run's passes count from (the data module's
    ``pass_origin``: a branch onto other data begins its first pass there), else 0."""
    origin = getattr(getattr(trainer, "datamodule", None), "pass_origin", 0)
    return origin if isinstance(origin, int) and not isinstance(origin, bool) else 0


class DatasetPasses(NamedTuple):
    """One dataset of a mixture: how often its own windows have been trained on."""

    name: str
    passes: float  # its windows served over its windows (1.5: halfway through its second)
    pass_tokens: int  # the tokens one pass over its windows trains on


def dataset_passes(trainer: Any, steps_ahead: int = 0) -> list[DatasetPasses] | None:
    """Each dataset's own passes of a mixture by :func:`order_position`, or None (one
    dataset, or no nanolab sampler). A mixture's ``epoch`` (:func:`data_passes`) counts the
    windows of all its datasets together, a pass over none of them: a dataset of a large
    share and few windows repeats while the ``epoch`` is still below 1, so what repeats, and
    how often, is said per dataset (counted from ``pass_origin``, as the epoch is)."""
    place = order_position(trainer, steps_ahead)
    if place is None:
        return None
    plan, position = place
    served, unit = getattr(plan, "served", None), unit_of(plan)
    if not callable(served) or unit is None:
        return None
    now, before = served(position * unit), served(pass_origin(trainer))
    block = int(plan.block_size)
    return [
        DatasetPasses(name, round(max(0, n - b) / own.num_windows, 4), own.num_windows * block)
        for name, n, b, own in zip(plan.names, now, before, plan.plans, strict=True)
    ]


def declared_pass_tokens(datamodule: Any) -> int | None:
    """Tokens one pass over the training data trains on, as ``datamodule`` says: its
    ``pass_tokens`` (``TokenDataModule``'s), else its ``split_tokens`` (a fork's module may say
    only that). ``None`` when it says neither, or its data cannot be read to say it."""
    for name in ("pass_tokens", "split_tokens"):
        try:
            tokens = getattr(datamodule, name, None)
        except Exception:  # a fork's data module whose metadata cannot be read: say nothing
            return None
        if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0:
            return tokens
    return None


def resume_jumps(
    saved: SavedOrder | None,
    plan: Any,
    start: int,
    accumulate: int,
    rollbacks: list[dict[str, Any]],
) -> tuple[list[Jump], Carried | None]:
    """The jumps (this launch's micro-batches) that make the order continue where ``saved``
    left it, and the rollbacks of the run that lie after it; with the :class:`Carried` of the
    resume point (``None`` when ``saved`` does not apply: a new run, or a module that does not
    record it, which continue as the ledger alone says).

    ``start`` is the consumed micro-batch count this launch restarts at (optimizer steps x
    ``accumulate``); a rollback in force at the checkpoint's own step replaces its position
    (a run rolled back to it goes on past the data it had reached), earlier ones are already in
    the checkpoint's position, and later ones jump where this launch reaches the window they
    restored: its first micro-batch at or after it, on to the first at or after the window they
    had reached. Placed by window, not by step, since a step of another global batch covers
    other windows: at ``step x accumulate`` a resume on a smaller batch would train again what
    the rollback skipped, one on a larger batch would skip healthy windows.
    """
    out, resumed, _ = resume_order(saved, plan, start, accumulate, rollbacks)
    return out, resumed


def resume_order(
    saved: SavedOrder | None,
    plan: Any,
    start: int,
    accumulate: int,
    rollbacks: list[dict[str, Any]],
) -> tuple[list[Jump], Carried | None, list[tuple[int, Carried]]]:
    """:func:`resume_jumps`, with where each later rollback goes on in this launch's
    micro-batches: (the step it restored, its :class:`Carried`), whose ``skipped`` windows a
    resume says as it says its own."""
    if saved is None or saved.step * accumulate != start:
        return jumps(rollbacks), None, []
    ledger_accumulate = saved.accumulate or accumulate
    position, unit = place_of(saved, ledger_accumulate, rollbacks, unit_of(plan))
    resumed = carry(plan, position, unit)
    out = [Jump(start, resumed.position - start)]
    went_on: list[tuple[int, Carried]] = []
    at, here = start, resumed.position  # this launch's micro-batch ``at`` trains ``here``
    for later in in_force(rollbacks, ledger_accumulate):
        if later.step <= saved.step:
            continue
        restored = carry(plan, later.restored, later.restored_unit or unit).position
        at += max(0, restored - here)
        reached = carry(plan, later.reached, later.unit or unit)
        here = reached.position
        out.append(Jump(at, here - at))
        went_on.append((later.step, reached))
    return out, resumed, went_on


def place_of(
    saved: SavedOrder, accumulate: int, rollbacks: list[dict[str, Any]], unit: int | None
) -> tuple[int, int | None]:
    """(position, unit) where checkpoint ``saved`` left the order: a rollback in force at its
    step (the run goes on from it past the data it had reached), else its record, else (a
    checkpoint before the record) its steps x ``accumulate`` with the run's jumps, in its
    layout's unit. ``unit`` counts a place that names none (this launch's)."""
    for entry in in_force(rollbacks, accumulate):
        if entry.step == saved.step:
            return entry.reached, entry.unit or saved.unit or unit
    if saved.position is not None:
        return saved.position, saved.unit or unit
    return data_position(saved.step * accumulate, jumps(rollbacks)), saved.unit or unit


@dataclass(frozen=True)
class InForce:
    """A rollback of the ledger still in force: it restored step ``step``, where the order
    stood at ``restored`` (micro-batches of ``restored_unit`` windows), and went on at
    ``reached`` (micro-batches of ``unit``), the place the spike had got to. A unit of
    ``None``: the entry predates it (the launch's own)."""

    step: int
    restored: int
    restored_unit: int | None
    reached: int
    unit: int | None


def in_force(rollbacks: list[dict[str, Any]], accumulate: int) -> list[InForce]:
    """The rollbacks in force, oldest first: a later rollback to an earlier step abandons those
    at or after it. ``accumulate`` dates an entry that does not name its step (its micro-batch
    count / accumulation)."""
    out: list[InForce] = []
    for i, r in enumerate(rollbacks):
        at = int(r["skip_at"])
        step = _count(r.get("restored"), 0)
        step = step if step is not None else at // max(1, accumulate)
        reached, unit = at + int(r["skip_offset"]), _count(r.get("unit"), 1)
        restored, restored_unit = restored_place(r, reached, unit, rollbacks[:i])
        entry = InForce(step, restored, restored_unit, reached, unit)
        out = [e for e in out if e.step < step] + [entry]
    return out


def restored_place(
    entry: dict[str, Any], reached: int, unit: int | None, before: list[dict[str, Any]]
) -> tuple[int, int | None]:
    """(position, unit) of the order at the checkpoint a ledger ``entry`` restored: its
    ``restored_position``/``restored_unit``; an entry written before them, ``reached`` less the
    micro-batches it skipped, or (without that count either) its ``skip_at`` with the jumps of
    the rollbacks ``before`` it, in its own ``unit``."""
    position = _count(entry.get("restored_position"), 0)
    if position is not None:
        return position, _count(entry.get("restored_unit"), 1) or unit
    skipped = _count(entry.get("skipped_micro_batches"), 0)
    if skipped is not None and skipped <= reached:
        return reached - skipped, unit
    return data_position(int(entry["skip_at"]), jumps(before)), unit


def skipped_line(
    carried: Carried, plan: Any, stopped: str = "the checkpoint stopped"
) -> str | None:
    """The warning of a resume that could not start exactly where its checkpoint stopped
    (``None`` when it does): where it stopped, where it goes on, how many windows that skips.
    ``stopped`` names the place: a rollback's jump carried into this launch says the same of
    the place it went on at (:func:`rollback_skipped_line`)."""
    if carried.skipped == 0:
        return None
    micro, world = plan.micro_batch_size, plan.world_size
    layout = f"micro-batch {micro} x {world} device(s) = {micro * world} windows"
    if carried.next_epoch:
        return (
            f"{stopped} {carried.window} windows into epoch {carried.epoch}'s "
            f"window order, and its remaining {carried.skipped} windows are less than one "
            f"micro-batch of this launch ({layout}): training goes on at the start of epoch "
            f"{carried.epoch + 1}, skipping them"
        )
    where = (
        f"epoch {carried.epoch}'s window order"
        if carried.epoch is not None
        else "the training order"
    )
    return (
        f"{stopped} {carried.window} windows into {where}, inside a micro-batch "
        f"of this launch ({layout}): training goes on at the next whole one, skipping "
        f"{carried.skipped} windows (a micro-batch x devices that divides {carried.window} "
        "skips none)"
    )


def rollback_skipped_line(step: int, carried: Carried, plan: Any) -> str | None:
    """The warning of a resume whose later rollback (to step ``step``) goes on inside a
    micro-batch of this launch, in the words of the resume point's own (:func:`skipped_line`);
    ``None`` when it goes on at a whole one."""
    return skipped_line(carried, plan, stopped=f"the rollback to step {step} went on")


def sampler_jumps(trainer: Any, plan: Any, start: int) -> tuple[list[Jump], list[str]]:
    """:func:`resume_jumps` for ``trainer``'s launch: the checkpoint's record (kept by the
    module when it restored, as ``restored_order``) and the run's rollback ledger; with the
    warnings of a resume that skips windows: at its own start, and at each rollback's jump it
    carries onto a whole micro-batch of this launch."""
    if trainer is None:
        return [], []
    rollbacks = read_ledger(getattr(trainer, "default_root_dir", None))
    module = getattr(trainer, "lightning_module", None)
    saved = getattr(module, "restored_order", None)
    saved = saved if isinstance(saved, SavedOrder) else None
    accumulate = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
    out, carried, went_on = resume_order(saved, plan, start, accumulate, rollbacks)
    lines = [skipped_line(carried, plan) if carried is not None else None]
    lines += [rollback_skipped_line(step, place, plan) for step, place in went_on]
    return out, [line for line in lines if line is not None]
