"""Options given twice are refused: argparse keeps the last value without a word."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["refuse_repeats"]


class _StoreOnce(argparse._StoreAction):
    """An option that takes one value, refused when given twice: argparse keeps the last,
    and ``--config a.yaml --config b.yaml`` trained on b's data and devices without a word."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        given: dict[str, Any] = namespace.__dict__.setdefault("_given_once", {})
        if self.dest in given:
            parser.error(
                f"{option_string} given twice ({given[self.dest]!r}, then {values!r}): give it once"
            )
        given[self.dest] = values
        super().__call__(parser, namespace, values, option_string)


def refuse_repeats(parser: argparse.ArgumentParser) -> None:
    """Make every option of ``parser`` and its subcommands that stores one value a
    :class:`_StoreOnce`."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                refuse_repeats(sub)
        elif type(action) is argparse._StoreAction and action.option_strings:
            action.__class__ = _StoreOnce
