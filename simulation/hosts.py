"""Grouped clients: a simulation's clients of one device profile train in one edge agent.

With ``group_clients: true`` a simulation does not run an agent per client. Each device
profile gets one host agent (an edge to the coordinator, with the profile's memory, speed and
link) that holds its clients' data and trains them on one built segment: every client starts
from the round's weights with a fresh optimizer and trains its own batches, its outputs
stream to the GPU server as the host's, and the host answers with its clients' weights
averaged by their examples. With ``interleave`` (the simulation's default) the clients step
in turns by their share of batches, as :class:`simulation.pace.Pacer` orders an agent per
client, each one's round put aside between its turns (:meth:`Segment.suspend`), so the GPU
server meets the host's clients mixed rather than one after another (which under label skew
fitted the back to the last ones).

For the FedAvg family (FedAvg, FedProx, FedAvgM, FedAdam, FedYogi, FedAdagrad) the
coordinator's mean of the hosts' means is the mean over the clients, so the run trains as one
with an agent per client, while the work that grew with the number of clients (a Flower
message each way, a lease, credits and a ``done`` per client, a reply to check and aggregate)
is done once per host (docs/benchmarks.md, "Grouped clients").

What it gives up: robust rules (Krum, medians, trimmed means, Bulyan) judge replies, which
are now hosts, so they are refused with grouping, as are per-client BatchNorm copies (FedBN),
backprop mode and stacked steps. Each host samples ``fraction_train`` of its clients a round
(the coordinator asks every host), skips the clients the availability settings take offline,
and the store, status and summary count hosts as the devices, with the clients they trained.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
from flwr.app import Error, Message, RecordDict

from edge_client.agent import EdgeAgent
from edge_client.jobs import Job
from edge_client.trainer import EdgeTrainer
from simulation.pool import HELD_BYTES, HELD_CLIENTS, HELD_PER_WEIGHT
from split_models.segment import Segment, StepResult, Suspended
from split_models.weights import load_segment_state, segment_state
from wire.flower import array_record, numpy_arrays, round_of

__all__ = ["ClientGroup", "HostAgent", "HostTrainer", "in_turns"]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class ClientGroup:
    """A host's clients: their names and the rows of the host's data each one holds."""

    names: tuple[str, ...]
    rows: tuple[np.ndarray, ...]

    def owners(self, size: int) -> np.ndarray:
        """The client index of each of the host's ``size`` rows."""
        owner = np.full(size, -1, dtype=np.int64)
        for index, rows in enumerate(self.rows):
            owner[rows] = index
        return owner


def in_turns(lists: Sequence[Sequence[T]], window: int) -> list[T]:
    """The items of ``lists`` in turns: within each ``window`` of consecutive lists (the ones
    in training at once), the list furthest behind in its share of items goes next, ties to
    the earlier, as :class:`simulation.pace.Pacer` orders a simulation's clients."""
    merged: list[T] = []
    for first in range(0, len(lists), window):
        chunk = [list(items) for items in lists[first : first + window]]
        heap = [(0.0, index) for index, items in enumerate(chunk) if items]
        taken = [0] * len(chunk)
        while heap:
            _, index = heapq.heappop(heap)
            merged.append(chunk[index][taken[index]])
            taken[index] += 1
            if taken[index] < len(chunk[index]):
                heapq.heappush(heap, (taken[index] / len(chunk[index]), index))
    return merged


class HostTrainer(EdgeTrainer):
    """Trains a host's clients on one segment (see the module docstring): each client's
    batches from its own shuffle, each client from the round's weights with a fresh optimizer;
    :meth:`mean` is their weights averaged by examples. With ``interleave`` the clients step in
    turns (:func:`in_turns`), each one's training put aside (:meth:`Segment.suspend`) while the
    others step, so the GPU server meets the host's clients mixed, not one after another."""

    def __init__(
        self, *args: object, group: ClientGroup, interleave: bool = False, **kwargs: object
    ) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.group, self.owner = group, group.owners(len(self.data))
        self.interleave = interleave
        self.chosen: list[int] = []
        self._start: dict[str, np.ndarray] = {}
        self._mu, self._current = 0.0, -1
        self._sum: dict[str, np.ndarray] = {}
        self._examples = 0
        self._left: dict[int, int] = {}  # batches each client has still to train this round
        self._aside: dict[int, Suspended] = {}

    def begin(self, weights: dict[str, np.ndarray], mu: float, chosen: Sequence[int]) -> None:
        """The round's weights, FedProx's weight and the clients (indices) that train."""
        self._start, self._mu, self.chosen = weights, mu, list(chosen)
        self._current, self._sum, self._examples = -1, {}, 0
        self._left, self._aside = {}, {}

    def _batches(self, generator: np.random.Generator) -> list[np.ndarray]:
        """Each client's batches, each client shuffled by a generator in the state
        ``generator`` starts in, so every client draws the order it draws as its own agent;
        in turns with ``interleave``, else one client's after another's."""
        state, batches = generator.bit_generator.state, []
        for client in self.chosen:
            fresh = np.random.Generator(type(generator.bit_generator)())
            fresh.bit_generator.state = state
            batches.append(self.batches_of(self.group.rows[client], fresh))
        self._left = {c: len(b) for c, b in zip(self.chosen, batches, strict=True)}
        if not self.interleave:
            return [batch for client in batches for batch in client]
        weights = sum(t.numel() * t.element_size() for t in self.segment.state_tensors())
        need = max(1, HELD_PER_WEIGHT * weights)
        return in_turns(batches, max(1, min(HELD_CLIENTS, HELD_BYTES // need)))

    def _batch(
        self,
        batch: np.ndarray,
        round_number: int,
        step: Callable[[torch.Tensor, torch.Tensor], StepResult],
        cancelled: Callable[[], bool] | None = None,
    ) -> float | None:
        client = int(self.owner[batch[0]])
        if client != self._current:
            self._leave_client()
            if client in self._aside:
                self.segment.resume(self._aside.pop(client))
            else:
                load_segment_state(self.segment, self._start)
                self.segment.reset_optimizer(self._mu)
            self._current = client
        loss = super()._batch(batch, round_number, step, cancelled)
        self._left[client] -= 1
        return loss

    def _leave_client(self) -> None:
        """The client trained so far steps aside: finished, or put aside for its next turn."""
        if self._current >= 0 and self._left.get(self._current, 0) > 0:
            self._aside[self._current] = self.segment.suspend()
            self._current = -1
        else:
            self._finish_client()

    def _train_all(self, *args: object, **kwargs: object) -> list[float]:
        losses = super()._train_all(*args, **kwargs)  # type: ignore[arg-type]
        self._finish_client()
        return losses

    def _finish_client(self) -> None:
        """Add the client just trained to the round's sum, weighted by its examples."""
        if self._current < 0:
            return
        examples = len(self.group.rows[self._current]) * self.config.local_epochs
        for key, array in segment_state(self.segment).items():
            if np.issubdtype(array.dtype, np.floating):
                self._sum[key] = self._sum.get(key, 0.0) + examples * array.astype(np.float64)
            else:
                self._sum[key] = array  # a count (BatchNorm's batches): the last client's
        self._examples += examples
        self._current = -1

    def mean(self) -> dict[str, np.ndarray]:
        """The clients' weights averaged by examples (the round's weights when none trained)."""
        if not self._examples:
            return {k: self._start[k] for k in segment_state(self.segment)}
        dtypes = {k: self._start[k].dtype for k in self._sum}  # the segment was loaded from these
        return {
            k: (v / self._examples).astype(dtypes[k])
            if np.issubdtype(dtypes[k], np.floating)
            else v
            for k, v in self._sum.items()
        }


class HostAgent(EdgeAgent):
    """An edge agent for a group of simulated clients (see the module docstring).
    ``choose(round, names)``: the clients that train round ``round`` (sampled, online)."""

    def __init__(
        self,
        *args: object,
        group: ClientGroup,
        choose: Callable[[int, Sequence[str]], list[str]],
        interleave: bool = False,
        **kwargs: object,
    ) -> None:
        self.group, self.choose, self.interleave = group, choose, interleave
        self._host: tuple[str, HostTrainer, Segment] | None = None
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def _host_trainer(self, job: Job) -> HostTrainer:
        """One segment and trainer per task (a new plan or session builds them anew)."""
        task = job.task
        key = dataclasses.replace(task, estimated_peak_bytes=0).to_json()
        if self._host is None or self._host[0] != key:
            segment, config = self._build_segment(job), self.trainer_config(job)
            gate = self._gate(task.run)
            trainer = HostTrainer(
                self.channel,
                gate,
                segment,
                self.data,
                config,
                group=self.group,
                interleave=self.interleave,
            )
            self._host = (key, trainer, segment)
        return self._host[1]

    def _train(
        self, message: Message, job: Job, cancelled: Callable[[], bool], handed: list[bool]
    ) -> Message:
        started, since = time.perf_counter(), time.monotonic()
        task, weights, number = job.task, numpy_arrays(message), round_of(message)
        trainer = self._host_trainer(job)
        trainer.segment.lr_scale = job.training.lr_scale(number)
        names = self.choose(number, self.group.names)
        if not names:  # counted as not trained this round, not as trained on nothing
            self._nothing_sent(task, number, job.attempt)
            why = f"none of {self.device}'s clients is online this round"
            return Message(Error(code=2, reason=why), reply_to=message)
        chosen = [self.group.names.index(n) for n in names]
        trainer.begin(weights, job.proximal_mu, chosen)
        handed[0] = True
        report = trainer.train_round(
            number,
            seed=job.training.seed,
            cancelled=cancelled,
            attempt=(job.attempt, job.order),
            offline=lambda: self.presence.offline(task.servers, since),
        )
        arrays = trainer.mean()
        self.rounds += 1
        self.log_round(number, report, -1, task.estimated_peak_bytes)
        traffic = (
            report.bytes_sent + sum(a.nbytes for a in arrays.values()),
            report.bytes_received + sum(w.nbytes for w in weights.values()),
        )
        metrics = self._metrics(task, report, -1, traffic, started)
        metrics["clients"] = len(chosen)
        content = RecordDict({"arrays": array_record(arrays), "metrics": metrics})
        return Message(content, reply_to=message)
