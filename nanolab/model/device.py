"""``--device`` as the checkpoint tools take it (``generate``, ``eval``): a device this machine
really has, checked with a one-element tensor, or one error line naming what is usable."""

from __future__ import annotations

import torch

from nanolab.errors import NanolabError


class DeviceError(NanolabError):
    """A ``--device`` this machine does not have; the message lists the usable ones."""


def check_device(text: str) -> torch.device:
    """The device ``--device`` names, if this machine has it (tried with a one-element tensor)."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise DeviceError(
            f"--device {text!r} is not a device name; use cpu, cuda, cuda:N or mps"
        ) from None
    if device.type == "meta":
        raise DeviceError("--device meta holds no data; use cpu, cuda, cuda:N or mps")
    try:
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError) as err:
        usable = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        if torch.backends.mps.is_available():
            usable.append("mps")
        why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DeviceError(
            f"--device {text}: not usable here ({why[:120]}); use --device {' or '.join(usable)}"
        ) from None
    return device
