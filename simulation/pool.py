"""Built segments shared by the many clients one simulation host runs.

With ``stacked``, clients whose segments can be stacked (``simulation.stack``) do not take
turns: each joins a slot of one :class:`~simulation.stack.SegmentStack` for its round and
their steps run together, one vmapped call for all the clients stepping at that moment (on
``device``, a GPU on a GPU host).

A deployment runs one edge agent a device, each holding its own built segment. A simulation runs
hundreds of clients in one process; holding a model copy, optimizer and warm-up per client makes
the cost grow with the number of clients instead of with the data trained. Agents are stateless
between rounds (every round brings its weights), so clients can borrow a built segment for the
round from a pool: segments are built (and warmed up) once per client training at once and
task, and an idle client holds only its data. The pool is the agents'
:class:`~edge_client.source.SegmentSource`.

With ``interleave`` (the default) the round's clients train at once, in turns by step
(:mod:`simulation.pace`), so the GPU server sees their batches mixed as a deployment's; up to
:data:`HELD_CLIENTS` clients and :data:`HELD_BYTES` of their weights and optimizer state hold a
segment at once (always ``workers``), and at most ``workers`` step at once. Without it each
client trains its round alone in one of ``workers`` slots, in name order.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Generic, TypeVar, cast

import numpy as np
import torch

from edge_client.source import SegmentLease, SegmentSource
from simulation.pace import Pacer
from simulation.stack import SegmentStack, StepGroup, stackable
from split_models.segment import Segment, StepResult

__all__ = ["HELD_BYTES", "HELD_CLIENTS", "HELD_PER_WEIGHT", "SegmentPool", "StackMember", "Turns"]

log = logging.getLogger(__name__)

T = TypeVar("T")

HELD_CLIENTS = 32  # clients holding a built segment at once, interleaved
HELD_BYTES = 1 << 30  # ... and their weights and optimizer state at most
HELD_PER_WEIGHT = 4  # what a client holding a segment takes, as a multiple of its weights


class SegmentPool(SegmentSource, Generic[T]):
    """``workers`` training slots and the built objects they reuse, by task key (as a
    segment source, ``T`` is :class:`~split_models.segment.Segment`)."""

    def __init__(
        self,
        workers: int,
        stacked: bool = False,
        capacity: int = 1,
        device: str = "cpu",
        interleave: bool = False,
    ) -> None:
        """``capacity``: how many clients may hold a slot of a stack at once."""
        if workers < 1:
            raise ValueError(f"workers: expected an integer >= 1, got {workers}")
        self.workers, self.interleave = workers, interleave
        self.pacer = Pacer(workers)
        self._held = threading.Condition()
        self._holding, self._held_bytes = 0, 0  # clients holding a segment, their bytes
        self.stacked, self.capacity, self.device = stacked, max(1, capacity), device
        self._groups: dict[str, StepGroup | None] = {}
        self._slots = threading.BoundedSemaphore(workers)
        self._lock = threading.Lock()
        self._free: dict[str, list[T]] = {}
        self.turns = Turns(10.0)
        self.pacer.coming = self.turns.coming
        self.built = 0  # how many objects were built: at most ``workers`` per key

    @contextmanager
    def borrow(self, key: str, build: Callable[[], T], holder: str = "") -> Iterator[T]:
        """A training slot (in ``holder``'s turn, see :meth:`expect`) and an object for
        ``key`` (built on first need), returned after."""
        self.turns.wait(holder)
        with self._slots:
            self.turns.took(holder)
            with self._item(key, build) as item:
                yield item

    @contextmanager
    def _item(self, key: str, build: Callable[[], T]) -> Iterator[T]:
        """A free object for ``key`` (built when none is), returned after."""
        with self._lock:
            free = self._free.setdefault(key, [])
            item = free.pop() if free else None
        if item is None:
            item = build()
            with self._lock:
                self.built += 1
        try:
            yield item
        finally:
            with self._lock:
                self._free.setdefault(key, []).append(item)

    @contextmanager
    def slot(self) -> Iterator[None]:
        """A training slot without a built object (other work that should not run wider)."""
        with self._slots:
            yield

    @contextmanager
    def lease(
        self,
        key: str,
        build: Callable[[], Segment],
        weights: Mapping[str, np.ndarray],
        stackable: bool = False,
        proximal_mu: float = 0.0,
        holder: str = "",
        ordered: bool = False,
    ) -> Iterator[SegmentLease]:
        """A slot of ``key``'s stack where the round can train stacked (not with a proximal
        term, which the stacked update does not add), else a segment held for the round,
        taken in ``holder``'s turn and loaded with ``weights``: interleaved with the other
        clients' steps (not when ``ordered``), or alone in a training slot."""
        if stackable and proximal_mu == 0 and self.can_stack(key, build):
            with self.member(key, weights) as member:
                yield member
            return
        if self.interleave and not ordered:
            need = HELD_PER_WEIGHT * sum(np.asarray(w).nbytes for w in weights.values())
            try:  # a client that fails to build is not waited for either
                with self.hold(key, cast(Callable[[], T], build), holder, need) as item:
                    lease = SegmentLease.fresh(cast(Segment, item), weights, proximal_mu)
                    lease.pace = Paced(self.pacer, holder)
                    yield lease
            finally:
                self.pacer.leave(holder)
            return
        with self.borrow(key, cast(Callable[[], T], build), holder) as item:
            yield SegmentLease.fresh(cast(Segment, item), weights, proximal_mu)

    @contextmanager
    def hold(self, key: str, build: Callable[[], T], holder: str, need: int) -> Iterator[T]:
        """An object for ``key`` held for ``holder``'s round (taken in its turn, when the
        clients holding one leave room for ``need`` bytes), returned after."""
        self.turns.wait(holder)
        with self._held:
            if not self._room(need):  # those holding one go on; it comes when one leaves
                self.pacer.queue(holder)
            while not self._room(need):
                self._held.wait()
            self._holding += 1
            self._held_bytes += need
            self.pacer.admit(holder)
        self.turns.took(holder)
        try:
            with self._item(key, build) as item:
                yield item
        finally:
            with self._held:
                self._holding -= 1
                self._held_bytes -= need
                hands_over = self.turns.coming() and self._room(need)
                self.pacer.leave(holder, hands_over)
                self._held.notify_all()

    def _room(self, need: int) -> bool:
        """Whether one more client may hold a segment of ``need`` bytes (see the module
        docstring)."""
        if self._holding < self.workers:
            return True
        return self._holding < HELD_CLIENTS and self._held_bytes + need <= HELD_BYTES

    def expect(self, holders: Iterable[str]) -> None:
        """The clients of the coming round: they get training slots in the order of their
        names (see :class:`Turns`), so with one worker the clients train, and stream to the
        GPU server, in the same order in every run."""
        holders = sorted(set(holders))
        self.turns.expect(holders)
        if self.interleave:  # the first to hold segments start together
            self.pacer.expect(holders[: max(self.workers, HELD_CLIENTS)])

    def can_stack(self, key: str, build: Callable[[], Segment]) -> bool:
        """Whether clients of ``key`` train stacked (the first call builds the stack)."""
        if not self.stacked:
            return False
        with self._lock:
            if key not in self._groups:
                template = build()
                self._groups[key] = (
                    StepGroup(SegmentStack(template, self.capacity, self.device))
                    if stackable(template)
                    else None
                )
            return self._groups[key] is not None

    @contextmanager
    def member(self, key: str, weights: Any) -> Iterator[StackMember]:
        """A slot of ``key``'s stack for one client's round, loaded with ``weights``."""
        group = self._groups.get(key)
        if group is None:
            raise ValueError(f"no stack for {key}; ask can_stack first")
        member = StackMember(group, group.join(weights))
        try:
            yield member
        finally:
            member.finish()

    @property
    def stack_counts(self) -> dict[str, int]:
        """Stacked steps run and client steps they served, over all stacks."""
        groups = [g for g in self._groups.values() if g is not None]
        return {
            "calls": sum(g.calls for g in groups),
            "client_steps": sum(g.client_steps for g in groups),
        }


class Turns:
    """The round's clients take their turns in name order. A client ahead that waits for a
    slot (or asks later but within ``patience`` seconds of its turn coming) is waited for; one
    that has not asked ``patience`` seconds after its turn came is passed over, once, and the rest
    keep their order. Only the client whose turn comes is woken, so a round of thousands of
    clients costs one wake-up per turn, not one per waiting client."""

    def __init__(self, patience: float) -> None:
        self.patience = patience
        self._lock = threading.Lock()
        self._order: list[str] = []  # the round's clients by name
        self._head = 0  # index in _order of the first client still to take its turn
        self._since = time.monotonic()  # when that client's turn came
        self._left: set[str] = set()  # clients still to take their turn
        self._asking: set[str] = set()  # clients waiting for their turn or for a slot
        self._waiting: dict[str, threading.Condition] = {}

    def expect(self, holders: Iterable[str]) -> None:
        with self._lock:
            self._order = sorted(set(holders))
            self._left, self._head = set(self._order), 0
            self._since = time.monotonic()
            for condition in self._waiting.values():
                condition.notify()

    def _first(self) -> str | None:
        """The client whose turn it is (``_since`` restarts when it changes)."""
        head = self._head
        while head < len(self._order) and self._order[head] not in self._left:
            head += 1
        if head != self._head:
            self._head, self._since = head, time.monotonic()
        return self._order[head] if head < len(self._order) else None

    def _wake_first(self) -> None:
        first = self._first()
        if first is not None and (condition := self._waiting.get(first)) is not None:
            condition.notify()

    def wait(self, holder: str) -> None:
        """Until it is ``holder``'s turn (at once for a client not of the round)."""
        with self._lock:
            self._asking.add(holder)
            condition = self._waiting[holder] = threading.Condition(self._lock)
            try:
                while holder in self._left and (first := self._first()) != holder:
                    assert first is not None  # holder itself is left
                    late = time.monotonic() - self._since
                    if first not in self._asking and late >= self.patience:
                        log.warning(
                            "%s did not ask for a training slot within %.0f s of its turn; "
                            "the clients after it go on",
                            first,
                            self.patience,
                        )
                        self._left.discard(first)
                        self._wake_first()
                        continue
                    condition.wait(self.patience if first in self._asking else self.patience - late)
            finally:
                del self._waiting[holder]

    def coming(self) -> bool:
        """Whether clients of the round are still to take their turn."""
        with self._lock:
            return bool(self._left)

    def took(self, holder: str) -> None:
        """``holder`` has its slot: the next client's turn comes."""
        with self._lock:
            self._asking.discard(holder)
            if holder in self._left:
                self._left.discard(holder)
                self._wake_first()


class Paced:
    """A client's turns by step (see :mod:`simulation.pace`)."""

    def __init__(self, pacer: Pacer, holder: str) -> None:
        self.pacer, self.holder = pacer, holder

    def begin(self, batches: int) -> None:
        self.pacer.join(self.holder, batches)

    def turn(self) -> AbstractContextManager[None]:
        return self.pacer.turn(self.holder)


class StackMember(SegmentLease):
    """One client's slot in a stack for a round."""

    def __init__(self, group: StepGroup, slot: int) -> None:
        super().__init__(group.stack.segment)  # blocks, head and cut: read-only here
        self.group, self.slot = group, slot
        self._state: dict[str, np.ndarray] | None = None

    def train_step(self, inputs: torch.Tensor, labels: torch.Tensor) -> StepResult:
        return self.group.train_step(self.slot, inputs, labels)

    def finish(self) -> dict[str, np.ndarray]:
        """Leave the stack (once); this client's weights after its round."""
        if self._state is None:
            self._state = self.group.leave(self.slot)
        return self._state

    def state(self) -> dict[str, np.ndarray]:
        return self.finish()
