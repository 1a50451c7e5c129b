"""Tell someone: a command of yours, or a notification service through apprise.

A *target* is one string. With ``://`` in it, it is an `apprise <https://github.com/caronc/apprise>`_
URL (``mailtos://user:pass@gmail.com``, ``slack://...``, ``ntfy://topic``, ``tgram://...``;
``pip install 'nanolab[notify]'``). Otherwise it is a command line: split like a shell would
split it (``shlex``), each word filled in with the event's fields (``{run}``, ``{reason}``,
``{val_loss}``, ...; ``{{`` for a brace), and run **without a shell**: a field's value is one
argument whatever it holds, so a run name cannot inject a command. Each target has 60 s.

A target that can never work (an unknown field, an apprise URL apprise does not know, apprise
not installed) is refused before the run starts. A target that fails when it is sent (not
found, non-zero exit, timeout, the service refusing) is one warning line on stderr and nothing
else: a notification never stops or fails a run or a queue.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import string
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

from nanolab.errors import NanolabError
from nanolab.messages import warn_line

TIMEOUT_S = 60.0


class NotifyConfigError(NanolabError):
    """A target that can never work (an unknown field, unbalanced quotes)."""


def check_targets(targets: Sequence[str], fields: Sequence[str], where: str) -> None:
    """Refuse, before any work, a target naming a field it will never get."""
    for i, target in enumerate(targets):
        if not isinstance(target, str) or not target.strip():
            raise NotifyConfigError(f"{where}[{i}]: give a command line or an apprise URL")
        if "://" in target:
            _check_apprise_url(target, f"{where}[{i}]")
            continue
        try:
            words = shlex.split(target)
        except ValueError as err:
            raise NotifyConfigError(f"{where}[{i}] {target!r}: {err}") from None
        for word in words:
            try:
                names = [n for _, n, _, _ in string.Formatter().parse(word) if n is not None]
            except ValueError as err:
                raise NotifyConfigError(f"{where}[{i}] {target!r}: {err}") from None
            unknown = [n for n in names if n not in fields]
            if unknown:
                raise NotifyConfigError(
                    f"{where}[{i}] names {{{unknown[0]}}}, which is not a field; use "
                    + ", ".join(f"{{{f}}}" for f in fields)
                )
            try:  # a conversion or format spec that cannot apply fails now, not at the end
                word.format_map(dict.fromkeys(fields, ""))
            except (KeyError, ValueError, IndexError, AttributeError) as err:
                raise NotifyConfigError(f"{where}[{i}] {target!r}: {err}") from None


def _check_apprise_url(url: str, where: str) -> None:
    """An apprise URL apprise cannot use fails now, not in the morning: apprise missing, or a
    scheme or form it does not know. (Whether the service accepts it shows only on sending.)"""
    try:
        import apprise
    except ImportError:
        raise NotifyConfigError(
            f"{where} is an apprise URL and apprise is not installed: "
            "pip install 'nanolab[notify]', or give a command line instead"
        ) from None
    if not apprise.Apprise().add(url):
        scheme = url.split("://", 1)[0]
        raise NotifyConfigError(
            f"{where}: apprise does not understand {scheme}://... (an unknown service or a "
            "malformed URL); see https://github.com/caronc/apprise/wiki for the URL of yours"
        )


def send(targets: Sequence[str], fields: Mapping[str, Any], title: str, body: str) -> list[str]:
    """Notify every target; returns the warnings (also printed), one per failed target."""
    values = {k: "" if v is None else str(v) for k, v in fields.items()}
    warnings = []
    for target in targets:
        try:
            problem = _apprise(target, title, body) if "://" in target else _command(target, values)
        except Exception as err:  # whatever a target does, the run or queue goes on
            problem = f"{type(err).__name__}: {err}"
        if problem:
            warnings.append(f"nanolab: warning: notify {_shown(target)} failed ({problem}); "
                            "nothing else is affected")  # fmt: skip
            warn_line(warnings[-1])
    return warnings


def _shown(target: str) -> str:
    """The target without what may be a secret (an apprise URL's credentials)."""
    if "://" in target:
        scheme, rest = target.split("://", 1)
        return f"{scheme}://{rest.split('@')[-1].split('/')[0]}/..."
    return repr(target if len(target) < 60 else target[:57] + "...")


def _command(template: str, values: Mapping[str, str]) -> str | None:
    try:
        argv = [word.format_map(values) for word in shlex.split(template)]
    except (KeyError, ValueError, IndexError) as err:
        return f"cannot fill in {template!r}: {err}"
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group: a timeout stops its children too
        )  # fmt: skip
    except FileNotFoundError:
        return f"no such command: {argv[0]}"
    except OSError as err:
        return f"{argv[0]}: {err.strerror or err}"
    try:
        out, err_bytes = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return f"still running after {TIMEOUT_S:.0f} s; stopped with its children"
    if proc.returncode != 0:
        text = (err_bytes or out or b"").decode("utf-8", errors="replace")
        last = text.strip().splitlines()
        return f"exit {proc.returncode}" + (f": {last[-1][:120]}" if last else "")
    return None


def _apprise(url: str, title: str, body: str) -> str | None:
    try:
        import apprise
    except ImportError:
        return "apprise is not installed: pip install 'nanolab[notify]'"
    try:
        sender = apprise.Apprise()
        if not sender.add(url):
            return "apprise does not understand this URL"
        return None if sender.notify(title=title, body=body) else "apprise could not deliver it"
    except Exception as err:  # a third-party service: never let it reach the run
        return f"{type(err).__name__}: {err}"
