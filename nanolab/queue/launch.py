"""How the queue starts a job: ``python -m nanolab.queue.launch fit --config ...``.

The same as ``nanolab fit``, plus what a job on a shared device needs before it allocates
anything: an allocator cap. ``queue run --pack`` sets :data:`CAP_ENV` to the share of the
device's memory the job may hold (its predicted peak plus the margin, over the device's size);
here it becomes ``torch.cuda.set_per_process_memory_fraction``, so a job that grows past its
prediction gets an out-of-memory error in its own process (which the runner answers by running
it alone) instead of taking memory its neighbours were promised. On a CPU there is no such cap
in PyTorch; the variable is ignored.

Termination signals are held first thing, as ``nanolab fit`` does, so a preemption during the
(CUDA-initialising) cap still ends in exit 75.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from nanolab.messages import say

#: Share of device 0's memory (0 < f <= 1) the job's caching allocator may hold.
CAP_ENV = "NANOLAB_QUEUE_MEMORY_FRACTION"


def apply_memory_cap(fraction: float) -> str:
    """Cap this process's allocator on its (only visible) device; says what was done.

    Raises ValueError for a fraction outside (0, 1].
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"{CAP_ENV}={fraction}: must be in (0, 1]")
    import torch

    if not torch.cuda.is_available():  # ROCm builds answer through torch.cuda as well
        return "no GPU visible: no allocator cap"
    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    total = torch.cuda.get_device_properties(0).total_memory
    return f"allocator capped at {fraction:.4f} of {total / 1024**3:.1f} GiB"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] != ["fit"]:
        return _launch(args)
    from nanolab.training import early_signals

    with early_signals.held_during_startup() as launch:  # this run's handlers only, then back
        launch.exit_code = _launch(args)
        return launch.exit_code


def _launch(args: list[str]) -> int:
    """Cap the GPU allocator when asked, then run ``args`` (``fit ...``) as ``nanolab`` would."""
    raw = os.environ.get(CAP_ENV)
    if raw:
        try:
            note = apply_memory_cap(float(raw))
        except ValueError as err:
            print(f"nanolab queue: error: {err}", file=sys.stderr)
            return 2
        say("nanolab queue", note)
    from nanolab.run.cli import run_lightning_cli

    return run_lightning_cli(args)


if __name__ == "__main__":
    sys.exit(main())
