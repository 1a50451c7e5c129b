"""The size rules of the token windows, pure and free of torch: ``nanolab fit`` applies them at
start-up (the DataModules, :class:`~nanolab.data.windows.WindowPlan`) and ``queue add`` applies
the same ones to a job before it waits in the queue, so a job is refused when it is added, not
when it starts overnight."""

from __future__ import annotations

from nanolab.data.prepare import PrepareError
from nanolab.errors import NanolabError


class DataTooSmallError(NanolabError):
    """The split holds fewer windows than one step of all ranks needs."""


def check_window_sizes(
    micro_batch_size: int, block_size: int | None, val_windows: int, num_workers: int
) -> None:
    """The sizes every window DataModule takes, each in range; one line naming the key if not."""
    for name, value in (
        ("micro_batch_size", micro_batch_size),
        ("block_size", block_size),
        ("val_windows", val_windows),
    ):
        if value is not None and value < 1:
            raise PrepareError(f"data.{name} must be >= 1, got {value}")
    if num_workers < 0:
        raise PrepareError(f"data.num_workers must be >= 0, got {num_workers}")


#: ``data.align``: fixed windows cut anywhere in the token stream, or rows of whole documents.
ALIGNS = ("stream", "document")


def check_align(align: object) -> None:
    """``data.align`` one of :data:`ALIGNS`; one line with both if not (the DataModule's
    check, which ``queue add`` makes too)."""
    if align not in ALIGNS:
        raise PrepareError(
            f"data.align must be 'stream' (windows anywhere) or 'document' (every window "
            f"starts at a document), got {align!r}"
        )


def stream_windows(num_tokens: int, block_size: int) -> int:
    """Windows per epoch of a split cut anywhere in its token stream. One block of slack is
    kept when the data allows, for the epoch's random shift."""
    n = (num_tokens - 1) // block_size
    return n - 1 if n >= 2 else n


def check_stream_fits(num_tokens: int, block_size: int, micro_batch_size: int, world: int) -> None:
    """A training split of ``num_tokens`` fills one window of ``block_size + 1`` tokens and one
    micro-batch on every rank (``data.align: stream``); one line with the fix if not."""
    if num_tokens < block_size + 1:
        raise DataTooSmallError(
            f"the training split has {num_tokens} tokens, fewer than one block "
            f"(block_size {block_size} + 1); add text or lower model.gpt.block_size"
        )
    windows = stream_windows(num_tokens, block_size)
    if windows // world // micro_batch_size < 1:
        raise DataTooSmallError(
            f"the training split has {windows} windows of {block_size + 1} "
            f"tokens, fewer than micro_batch_size x world_size = "
            f"{micro_batch_size * world}; add text or lower data.micro_batch_size"
        )


def check_validation_fits(num_tokens: int, block_size: int) -> None:
    """A validation split of ``num_tokens`` holds one window of ``block_size + 1`` tokens;
    one line with the fix if not."""
    if num_tokens < block_size + 1:
        raise DataTooSmallError(
            f"the validation split has {num_tokens} tokens, fewer than one block "
            f"(block_size {block_size} + 1); add text, raise val_fraction or lower block_size"
        )
