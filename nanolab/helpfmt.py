"""Help pages that show each option's default beside what it means (``prepare``, ``generate``).

argparse's own ``ArgumentDefaultsHelpFormatter`` also prints ``(default: None)`` and
``(default: False)`` for options that have no default and for on/off flags; this one leaves
those out, and options whose help already names their default.
"""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to every option's help that has a real default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or default is None
            or default is argparse.SUPPRESS
            or isinstance(default, bool)
            or "default" in text
        ):
            return text
        return f"{text} (default: %(default)s)"
