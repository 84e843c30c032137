"""Fixtures of the fault-injection suite (issue 17). The private mosquitto is the
module-scoped ``broker`` fixture of ``tests/conftest.py``; helpers live in
``tests/faults/watch.py`` (``benchmarks/faults.py`` uses them too).

Every test here is bounded: rounds are short (few examples per edge), every wait has a limit,
and nothing asserts on elapsed time (what a fault costs is measured by
``benchmarks/faults.py``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.deployment import Deployment
from tests.faults.watch import StreamWatch, deployed
from wire.broker import Broker

Fleet = Callable[..., tuple[Deployment, StreamWatch]]


@pytest.fixture(scope="module")
def fleet(broker: Broker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Makes deployments on the module's broker, each in a fresh folder with a watch on its
    streams (``fleet(rounds=3, per_edge=160, ...)``, not started); all are stopped after the
    module's tests."""
    with contextlib.ExitStack() as stack:

        def make(**options: Any) -> tuple[Deployment, StreamWatch]:
            directory = Path(tmp_path_factory.mktemp("fleet"))
            return stack.enter_context(deployed(broker.url, directory, **options))

        yield make
