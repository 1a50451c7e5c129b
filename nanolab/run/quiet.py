"""Lightning's start-up chatter, silenced for ``nanolab fit / validate / test``.

A nanolab run prints its own banner (model, batch, devices, precision, run directory, resume
point, estimate: :mod:`nanolab.callbacks.banner`), so these lines only push it off the screen:
the accelerator inventory ("GPU available: False, used: False"), a cloud-logging tip, "Seed set
to", checkpoint restore notices (the banner or the evaluation line names the checkpoint), "`Trainer.fit` stopped:
`max_steps=N` reached", a ``FutureWarning`` from Lightning's own use of a deprecated torch
pytree class, and on CPU the expected "MFU unknown" (CPUs have no peak-FLOPs table; records
carry ``mfu: null`` as docs/callbacks.md says). Warnings and errors of every other kind still
show. ``nanolab -v fit ...`` (or ``NANOLAB_VERBOSITY=verbose``, or the older
``NANOLAB_VERBOSE=1``) keeps Lightning's output as it is (:mod:`nanolab.messages`).
"""

from __future__ import annotations

import logging
import warnings

#: Start of an INFO line from Lightning that nanolab's banner makes redundant.
NOISE_PREFIXES = (
    "💡 Tip:",
    "GPU available:",
    "TPU available:",
    "HPU available:",
    "IPU available:",
    "LOCAL_RANK:",
    "Seed set to",
    "`Trainer.fit` stopped:",
    # "... Logging and checkpointing is suppressed": Lightning's loggers are, nanolab's run log
    # and checkpoints are not (configs/debug/fast_dev_run.yaml says so)
    "Running in `fast_dev_run` mode",
)

#: Restore notices: the banner (``fit``) or the evaluation's own line (``validate``/``test``)
#: names the checkpoint file and its step; Lightning's name the descriptor the picked file is
#: read through (``/proc/self/fd/N``, so a live run's rotation cannot pull it away).
RESTORE_PREFIXES = (
    "Restoring states from the checkpoint",
    "Restored all states from the checkpoint",
    "Loaded model weights from the checkpoint",
)

#: Loggers those lines come from (filters on a logger only see records created there).
NOISY_LOGGERS = (
    "lightning.pytorch.utilities.rank_zero",
    "lightning.fabric.utilities.rank_zero",
    "lightning.fabric.utilities.seed",
    "lightning.pytorch.accelerators.cuda",
    "lightning.pytorch",
)


class _DropNoise(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.prefixes = NOISE_PREFIXES

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO:
            return True
        try:
            message = str(record.getMessage()).lstrip()
        except Exception:  # a malformed record is not ours to judge
            return True
        return not message.startswith(self.prefixes)


_FILTER = _DropNoise()


def quiet_lightning() -> bool:
    """Install the filters (idempotent); False when ``NANOLAB_VERBOSE`` asks for everything."""
    from nanolab.messages import verbosity

    if verbosity() == "verbose":
        return False
    _FILTER.prefixes = NOISE_PREFIXES + RESTORE_PREFIXES
    for name in NOISY_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
    )
    warnings.filterwarnings("ignore", message=r"MFU unknown \(no peak-FLOPs table for cpu")
    # validate/test from a fit checkpoint: the run clock is attached by fit itself, not missing
    warnings.filterwarnings(
        "ignore", message=r"(?s)Be aware that when using `ckpt_path`.*\['RunClock'\]\.?\s*$"
    )
    return True
