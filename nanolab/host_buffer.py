"""A mark for host memory whose reads never wait for a device.

nanolab's sync counter (``nanolab.callbacks.syncs``) counts every read of a tensor's value as a
wait for the device, which is right for device tensors and for a CPU run standing in for one.
A host buffer read only once the copy into it is known to be done (the step readout's), or a
batch still in host memory before it moves (the look for masked targets), never waits: such a
tensor carries this mark, and the counter leaves its reads out. It lives in the bottom layer so
the training layer can mark what it reads without importing the callbacks.
"""

from __future__ import annotations

from typing import Any

#: Set on a host buffer that is read only after its copy finished (:func:`mark_host_buffer`).
HOST_BUFFER = "_nanolab_host_buffer"


def mark_host_buffer(tensor: Any) -> Any:
    """Mark ``tensor`` as host memory that is read only once the copy into it is known to be
    finished (a CUDA event queried done): its reads never wait for the device, so they are not
    counted, on a CPU as on a GPU (on a CPU every tensor looks like one that would wait)."""
    setattr(tensor, HOST_BUFFER, True)
    return tensor
