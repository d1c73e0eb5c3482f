"""``fedopt-sim --help`` shows every option's default.

argparse's own ``ArgumentDefaultsHelpFormatter`` also prints "(default: None)" for options whose
default is worked out later and "(default: False)" for plain flags; this one appends
"(default X)" only where there is a value to show and the help text does not give it already.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any


def shown_default(value: Any) -> str:
    """How ``--help`` writes a default: on/off for switches, space-separated for lists."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value)
    return str(value)


def has_default_to_show(action: argparse.Action) -> bool:
    """An option with a value when it is not given: not None, not a plain flag's False."""
    if action.default is None or action.default is argparse.SUPPRESS or not action.option_strings:
        return False
    return not (isinstance(action, argparse._StoreTrueAction) and action.default is False)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends "(default X)" to an option's help unless the text already says its default; an
    option without help gets "default X" as its help."""

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and has_default_to_show(action):
            action = copy.copy(action)  # argparse prints no help line at all for help=None
            action.help = f"default {shown_default(action.default)}".replace("%", "%%")
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if has_default_to_show(action) and "default" not in text:
            text += f" (default {shown_default(action.default)})".replace("%", "%%")
        return text
