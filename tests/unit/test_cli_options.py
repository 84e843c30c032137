"""Options that take one value are refused when given twice (argparse keeps the last)."""

from __future__ import annotations

import pytest

from edgesplit.cli import build_parser

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "--config", "a.yaml", "--config", "b.yaml"],
        ["simulate", "--out", "sim-out", "--rounds", "2", "--out", "other"],
        ["status", "--db", "x.db", "--db", "y.db"],
        ["coordinator", "--config", "run.yaml", "--db-outage-wait", "5", "--db-outage-wait", "9"],
    ],
)
def test_an_option_given_twice_is_refused_naming_both_values(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``--config a.yaml --config b.yaml`` trained on b's data and devices without a word."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    option = argv[-2]
    assert f"{option} given twice" in error and argv[-1] in error, error


def test_options_given_once_and_repeatable_ones_still_parse() -> None:
    args = build_parser().parse_args(["simulate", "--config", "a.yaml", "--out", "o"])
    assert (args.config, args.out) == ("a.yaml", "o")
    args = build_parser().parse_args(["status", "--db", "x.db", "--run", "r"])
    assert (args.db, args.run) == ("x.db", "r")
