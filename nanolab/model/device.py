"""``--device`` as the checkpoint tools take it (``generate``, ``eval``): a device this machine
really has, checked with a one-element tensor, or one error line naming what is usable."""

from __future__ import annotations

import torch

from nanolab.errors import NanolabError


class DeviceError(NanolabError):
    """A ``--device`` this machine does not have; the message lists the usable ones."""


def check_device(text: str, flag: str = "--device") -> torch.device:
    """The device ``--device`` names, if this machine has it (tried with a one-element tensor);
    ``flag`` is the setting as the user gave it (``lm-eval`` takes ``device`` two ways)."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise DeviceError(
            f"{flag} {text!r} is not a device name; use cpu, cuda, cuda:N or mps"
        ) from None
    if device.type == "meta":
        raise DeviceError(f"{flag} meta holds no data; use cpu, cuda, cuda:N or mps")
    try:
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError) as err:
        usable = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        if torch.backends.mps.is_available():
            usable.append("mps")
        why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DeviceError(
            f"{flag} {text}: not usable here ({why[:120]}); use {flag} {' or '.join(usable)}"
        ) from None
    return device
