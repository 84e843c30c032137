"""Edges that stay online and answer nothing: a device that takes its work and never replies
held every round to its full deadline (300 s by default) for as long as it liked, since the
coordinator asks every online edge of the plan each round.

After :data:`STRIKES` tries in a row in which it was online and sent no reply before the
deadline, an edge is benched: sent no work for a number of rounds that doubles each time it
is benched again (1, 2, 4, ... at most :data:`LONGEST`), then asked again. A reply of any kind
(trained, or an error it names) ends its strikes and its doubling. A bench never leaves a
round fewer edges than it needs (``min_train_nodes``): then everyone is asked, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from flwr.app import Message

from coordinator.recorder import Outcome
from coordinator.replies import NO_REPLY

__all__ = ["LONGEST", "STRIKES", "Bench"]

STRIKES = 2  # tries in a row online without a reply before an edge is benched
LONGEST = 8  # rounds a bench lasts at most


@dataclass
class _Record:
    strikes: int = 0  # tries in a row online without a reply
    benched: int = 0  # benches since its last reply
    until: int = 0  # the first round it is asked again


class Bench:
    """The benched edges, by node id (a coordinator process's; a restart learns them anew)."""

    def __init__(self) -> None:
        self._records: dict[int, _Record] = {}

    def after(
        self,
        number: int,
        outcome: Outcome,
        messages: Mapping[str, Message],
        event: Callable[[int, str, str, str], None],
        servers: Collection[str] = (),
    ) -> None:
        """Count a try of round ``number`` (``messages``: what each device was sent, by name;
        ``event(number, kind, detail, device)`` records a bench; ``servers``, the GPU servers
        among them, are no edges to bench)."""
        late = {r.device for r in outcome.results if r.failure == NO_REPLY}
        for device, message in messages.items():
            if device in servers:
                continue
            record = self._records.setdefault(message.metadata.dst_node_id, _Record())
            if device not in outcome.silent:  # it answered: trained, or said why not
                record.strikes = record.benched = 0
            elif device in late:
                record.strikes += 1
            if record.strikes < STRIKES:
                continue
            rounds = min(LONGEST, 2**record.benched)
            record.strikes, record.until = 0, number + 1 + rounds
            record.benched += 1
            event(
                number,
                "device-benched",
                f"{device} was online but sent {NO_REPLY} in {STRIKES} tries in a row: not "
                f"waited for in the next {rounds} round(s); asked again from round {record.until}",
                device,
            )

    def choose(self, number: int, nodes: Sequence[int], least: int) -> list[int]:
        """``nodes`` without those benched for round ``number``, unless that leaves fewer
        than ``least``."""
        kept = [n for n in nodes if self._records.get(n, _Record()).until <= number]
        return kept if len(kept) >= least else list(nodes)
