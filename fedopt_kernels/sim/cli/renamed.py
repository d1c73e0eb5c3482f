"""Options that were renamed: the earlier spelling still works, and says so once on stderr.

``add_argument("--new", "--old", action=RenamedStore, help=...)`` (or ``RenamedFlag`` for a switch):
the first option string is the option's name, the others its earlier spellings. Given an earlier one,
the option acts as usual and prints once (per parser), on stderr, that the spelling is deprecated and
which option to use.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional, Sequence, Set


class _Renamed(argparse.Action):
    """The shared part: remember the earlier spellings said this parse, and say each once."""

    said: Set[str]

    def earlier(self) -> Sequence[str]:
        return self.option_strings[1:]

    def say_once(self, parser: argparse.ArgumentParser, option_string: Optional[str]) -> None:
        said = self.__dict__.setdefault("said", set())
        if option_string in self.earlier() and option_string not in said:
            said.add(option_string)
            print(
                f"{parser.prog}: {option_string} is deprecated, use {self.option_strings[0]} (same meaning)",
                file=sys.stderr,
            )


class RenamedStore(argparse._StoreAction, _Renamed):
    """``store``, under a new name and earlier ones."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string=None
    ) -> None:
        self.say_once(parser, option_string)
        super().__call__(parser, namespace, values, option_string)


class RenamedFlag(argparse._StoreTrueAction, _Renamed):
    """``store_true``, under a new name and earlier ones."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string=None
    ) -> None:
        self.say_once(parser, option_string)
        super().__call__(parser, namespace, values, option_string)
