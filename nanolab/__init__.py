"""nanolab: train nanoGPT-scale language models with PyTorch Lightning, keeping every GPU-hour busy."""

import time as _time

__version__ = "0.1.0"

#: ``time.monotonic()`` when nanolab's code started in this process. Run time is counted from
#: here, not from the process start: a shell that exec'd into nanolab (``sh -c 'setup && exec
#: nanolab fit ...'``) may have spent minutes installing or waiting first, which no run paid for.
STARTED_MONOTONIC = _time.monotonic()
