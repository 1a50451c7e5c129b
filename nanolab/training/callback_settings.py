"""The rules of the run callbacks' settings, without Lightning.

``nanolab fit`` checks them when it builds its callbacks; ``queue add`` checks the same rules
for each job it queues, and must not import Lightning (seconds a launch) to do so. So the
rules of a group a recipe commonly sets live here, below the callbacks, and the callback's
constructor calls them: one rule, one message, wherever it is checked. A group without rules
here is checked by building its callback (:data:`SETTING_RULES` says which are here).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from nanolab.errors import NanolabError


class CallbackConfigError(NanolabError):
    """A callback setting that cannot work; the message names the YAML key and the fix."""


def check_checkpoint(settings: Mapping[str, Any]) -> None:
    """``checkpoint.*``: where checkpoints live, how often and how many are kept."""
    dirpath = settings.get("dirpath")
    if dirpath is not None:  # another folder: resume would not find its checkpoints
        raise CallbackConfigError(
            f"checkpoint.dirpath {dirpath}: checkpoints live in <run_dir>/checkpoints, where "
            "a resume finds them (elsewhere a restart begins at step 0 and rotates them "
            "away); drop the setting, and to keep them on another disk set run.root there "
            "or make <run_dir>/checkpoints a link to a folder on it"
        )
    every_n_steps = settings.get("every_n_steps")
    if every_n_steps is not None and every_n_steps < 1:
        raise CallbackConfigError(
            f"checkpoint.every_n_steps must be >= 1 or null (no step-based saves), got {every_n_steps}"
        )
    every_n_minutes = settings.get("every_n_minutes")
    if every_n_minutes is not None and not every_n_minutes > 0:
        raise CallbackConfigError(
            f"checkpoint.every_n_minutes must be > 0 or null (no time-based saves), got {every_n_minutes}"
        )
    for name in ("keep_last", "keep_best"):
        value = settings.get(name, 0)
        if value < 0:
            raise CallbackConfigError(f"checkpoint.{name} must be >= 0, got {value}")
    max_disk_gb = settings.get("max_disk_gb")
    if max_disk_gb is not None and not max_disk_gb > 0:
        raise CallbackConfigError(
            f"checkpoint.max_disk_gb must be > 0 or null (no cap), got {max_disk_gb}"
        )


def check_downstream(settings: Mapping[str, Any]) -> None:
    """``downstream.*``: how often the in-loop tasks are scored, on how many examples and rows
    (whether the suite itself exists is read where it is loaded)."""
    every_n_evals = settings.get("every_n_evals", 1)
    if every_n_evals < 1:
        raise CallbackConfigError(f"downstream.every_n_evals must be >= 1, got {every_n_evals}")
    for name in ("limit", "rows"):
        value = settings.get(name)
        if value is not None and value < 1:
            raise CallbackConfigError(f"downstream.{name} must be >= 1 or null, got {value}")


#: The groups whose rules are checked here, by group name.
SETTING_RULES: dict[str, Callable[[Mapping[str, Any]], None]] = {
    "checkpoint": check_checkpoint,
    "downstream": check_downstream,
}
