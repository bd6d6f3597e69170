"""Every argument of every ``keygate`` command explains itself in ``--help``."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from gateway.cli import build_parser, main


def _arguments(parser: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, argparse.Action]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _arguments(sub, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield path, action


def test_every_flag_and_argument_has_help_text() -> None:
    bare = [f"{path} {a.dest}" for path, a in _arguments(build_parser(), "keygate") if not a.help]
    assert bare == []


def test_queue_flags_come_from_the_settings_table_with_units(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["queue", "--help"])
    text = capsys.readouterr().out
    assert "--rebalance-delay SECONDS" in text
    assert "--max-depth-bytes BYTES" in text
    assert "dead-letter expired messages" in text
