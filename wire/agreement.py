"""The end of a round on a stream, agreed by counting: plain data, no transport, no clock.

Each sender of a stream (an edge, or a chained GPU server passing batches on) says how many
batches it sent in the round (its ``done`` message, heard by every server). Each server counts
the batches of each sender it handled, trained or rejected (a rejected batch is one batch
fewer to wait for), and tells its peers sharing the stream (``processed``). A sender is
finished when the counts of all servers add up to what it said it sent. With one server the
counts are its own; with several behind one shared subscription, no server sees every batch,
and a ``last`` flag on a batch would reach only one of them, so counting is the one mechanism.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["RoundLedger", "SenderMajor"]


class RoundLedger:
    """One server's view of one round of a stream: who must finish, what each sender said it
    sent, and what each server (``me`` and its ``peers``) handled of it."""

    def __init__(
        self, number: int, senders: Iterable[str], me: str, peers: Iterable[str] = ()
    ) -> None:
        self.number, self.me = number, me
        self.senders = frozenset(senders)
        self.peers = frozenset(peers) - {me}
        self.declared: dict[str, int] = {}
        self.counts: dict[str, collections.Counter[str]] = {me: collections.Counter()}
        self.finished: set[str] = set()
        self.gone: set[str] = set()  # senders that left the round (offline)
        # senders whose declaration or counts changed since the last settle: only they can
        # have become finished (settling every sender each time was quadratic in senders)
        self._changed: set[str] = set()

    def declare(self, sender: str, batches: int) -> bool:
        """``sender`` sent ``batches`` this round; False when it is not a sender of it."""
        if sender not in self.senders:
            return False
        self.declared[sender] = batches
        self._changed.add(sender)
        return True

    def leave(self, sender: str) -> bool:
        """``sender`` went offline: stop waiting for it; False when it is not a sender of the
        round, or finished or left already."""
        if sender not in self.senders or sender in self.finished or sender in self.gone:
            return False
        self.gone.add(sender)
        return True

    def handled(self, sender: str) -> bool:
        """This server handled one batch of ``sender``; False when it is not a sender."""
        if sender not in self.senders:
            return False
        self.counts[self.me][sender] += 1
        self._changed.add(sender)
        return True

    def peer_counts(self, peer: str, counts: Mapping[str, int]) -> bool:
        """``peer``'s latest counts; False (ignored) unless it is a peer of this round."""
        if peer not in self.peers:
            return False
        before = self.counts.get(peer, collections.Counter())
        self.counts[peer] = collections.Counter(counts)
        self._changed.update(before.keys() | self.counts[peer].keys())
        return True

    @property
    def own_counts(self) -> dict[str, int]:
        return dict(self.counts[self.me])

    def settle(self) -> set[str]:
        """Mark the senders whose counts now add up as finished; return the new ones."""
        new = set()
        for sender in self._changed:
            batches = self.declared.get(sender)
            if batches is None or sender in self.finished:
                continue
            if sum(counts[sender] for counts in self.counts.values()) >= batches:
                new.add(sender)
        self._changed.clear()
        self.finished |= new
        return new

    def short(self) -> dict[str, int]:
        """The senders that said what they sent but whose batches do not add up yet (not
        finished, not left), with how many are still to come: a gap in the stream when no
        more arrive (a broker that lost messages)."""
        done = self.finished | self.gone
        return {
            sender: batches - sum(counts[sender] for counts in self.counts.values())
            for sender, batches in sorted(self.declared.items())
            if sender not in done
        }

    @property
    def complete(self) -> bool:
        """Every sender of the round is finished or left (at once for a round without
        senders)."""
        return self.senders <= self.finished | self.gone


class SenderMajor:
    """The batches of one round in sender-major order: all of the first sender's (by name),
    then the next's; a sender's turn ends when it is ``finished``."""

    def __init__(self, senders: Iterable[str]) -> None:
        self.turns = sorted(senders)
        self.queues: dict[str, collections.deque[Any]] = {
            s: collections.deque() for s in self.turns
        }

    def push(self, sender: str, envelope: Any) -> None:
        self.queues[sender].append(envelope)

    def drain(
        self, finished: Callable[[str], bool], handle: Callable[[str, Any], None]
    ) -> list[str]:
        """Handle every batch whose turn it is; the senders of those handled, in order."""
        done: list[str] = []
        while self.turns:
            sender = self.turns[0]
            if self.queues[sender]:
                handle(sender, self.queues[sender].popleft())
                done.append(sender)
            elif finished(sender):
                self.turns.pop(0)
            else:
                break
        return done
