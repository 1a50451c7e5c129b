"""Lightning callbacks that account for every GPU-hour of a run.

* :class:`MetricsLog` — ``<run_dir>/metrics.jsonl``, the run log (schema in docs/callbacks.md);
* :class:`RotatingCheckpoint` — atomic, optionally asynchronous checkpoints with rotation;
* :class:`CostBudget` — GPU-hour / money / wall-time / token budgets, payoff and plateau stops;
* :class:`ThroughputMeter` — tokens/s, MFU, memory, utilisation, goodput;
* :class:`StepProgressBar` — a tqdm bar over optimizer steps with ETA, loss and tokens/s;
* :class:`RunClock` — the single timing source the others share (attached automatically);
* :class:`StepCallback` — their base: "an optimizer step finished", once, in a fixed order
  (docs/callbacks.md, "Writing your own step callback").

``nanolab fit`` turns all of them on (YAML groups ``log``, ``checkpoint``, ``budget``,
``throughput``, ``progress``). Code that stops a run for its own reason records it with
:func:`set_stop_reason` so the ``end`` record carries it.
"""

from nanolab.callbacks.budget import CostBudget
from nanolab.callbacks.checkpoint import RotatingCheckpoint
from nanolab.callbacks.checkpoint_io import (
    AsyncAtomicCheckpointIO,
    AtomicCheckpointIO,
    CheckpointWriteError,
)
from nanolab.callbacks.clock import RunClock
from nanolab.callbacks.events import END_REASONS, CallbackConfigError, set_stop_reason, stop_reason
from nanolab.callbacks.jsonl import MetricsLog
from nanolab.callbacks.progress import StepProgressBar
from nanolab.callbacks.rundir import RunDirError, claim_run_dir
from nanolab.callbacks.step import StepCallback
from nanolab.callbacks.throughput import ThroughputMeter
from nanolab.runlog import read_records

__all__ = [
    "END_REASONS",
    "AsyncAtomicCheckpointIO",
    "AtomicCheckpointIO",
    "CallbackConfigError",
    "CheckpointWriteError",
    "CostBudget",
    "MetricsLog",
    "RotatingCheckpoint",
    "RunClock",
    "RunDirError",
    "StepCallback",
    "StepProgressBar",
    "ThroughputMeter",
    "claim_run_dir",
    "read_records",
    "set_stop_reason",
    "stop_reason",
]
