"""Grouped clients: a simulation's clients of one device profile train in one edge agent.

With ``group_clients: true`` a simulation does not run an agent per client. Each device
profile gets one host agent (an edge to the coordinator, with the profile's memory, speed and
link) that holds its clients' data and trains them in turn on one built segment: every client
starts from the round's weights with a fresh optimizer and trains its own batches, its outputs
stream to the GPU server as the host's, and the host answers with its clients' weights
averaged by their examples. For the FedAvg family (FedAvg, FedProx, FedAvgM, FedAdam, FedYogi,
FedAdagrad) the coordinator's mean of the hosts' means is the mean over the clients, so the
run trains as one with an agent per client, while the work that grew with the number of
clients (a Flower message each way, a lease, credits and a ``done`` per client, a reply to
check and aggregate) is done once per host (docs/benchmarks.md, "Grouped clients").

What it gives up: robust rules (Krum, medians, trimmed means, Bulyan) judge replies, which
are now hosts, so they are refused with grouping, as are per-client BatchNorm copies (FedBN),
backprop mode and stacked steps. Each host samples ``fraction_train`` of its clients a round
(the coordinator asks every host), skips the clients the availability settings take offline,
and the store, status and summary count hosts as the devices, with the clients they trained.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import Error, Message, RecordDict

from edge_client.agent import EdgeAgent, _Job
from edge_client.trainer import EdgeTrainer
from split_models.segment import Segment, StepResult
from split_models.weights import load_segment_state, segment_state
from wire.flower import array_record, numpy_arrays, round_of

__all__ = ["ClientGroup", "HostAgent", "HostTrainer"]

log = logging.getLogger(__name__)


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


class HostTrainer(EdgeTrainer):
    """Trains a host's clients one after another on one segment (see the module docstring):
    each client's batches from its own shuffle, each client from the round's weights with a
    fresh optimizer; :meth:`mean` is their weights averaged by examples."""

    def __init__(self, *args: object, group: ClientGroup, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.group, self.owner = group, group.owners(len(self.data))
        self.chosen: list[int] = []
        self._start: dict[str, np.ndarray] = {}
        self._mu, self._current = 0.0, -1
        self._sum: dict[str, np.ndarray] = {}
        self._examples = 0

    def begin(self, weights: dict[str, np.ndarray], mu: float, chosen: Sequence[int]) -> None:
        """The round's weights, FedProx's weight and the clients (indices) that train."""
        self._start, self._mu, self.chosen = weights, mu, list(chosen)
        self._current, self._sum, self._examples = -1, {}, 0

    def _batches(self, generator: np.random.Generator) -> list[np.ndarray]:
        """Each client's batches in turn, each client shuffled by a generator in the state
        ``generator`` starts in, so every client draws the order it draws as its own agent."""
        state, batches = generator.bit_generator.state, []
        for client in self.chosen:
            fresh = np.random.Generator(type(generator.bit_generator)())
            fresh.bit_generator.state = state
            batches += self.batches_of(self.group.rows[client], fresh)
        return batches

    def _batch(
        self,
        batch: np.ndarray,
        round_number: int,
        step: Callable[[torch.Tensor, torch.Tensor], StepResult],
        cancelled: Callable[[], bool] | None = None,
    ) -> float | None:
        client = int(self.owner[batch[0]])
        if client != self._current:
            self._finish_client()
            load_segment_state(self.segment, self._start)
            self.segment.reset_optimizer(self._mu)
            self._current = client
        return super()._batch(batch, round_number, step, cancelled)

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
        **kwargs: object,
    ) -> None:
        self.group, self.choose = group, choose
        self._host: tuple[str, HostTrainer, Segment] | None = None
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def _host_trainer(self, job: _Job) -> HostTrainer:
        """One segment and trainer per task (a new plan or session builds them anew)."""
        task = job.task
        key = dataclasses.replace(task, estimated_peak_bytes=0).to_json()
        if self._host is None or self._host[0] != key:
            segment, config = self._build_segment(job), self.trainer_config(job)
            gate = self._gate(task.run)
            trainer = HostTrainer(self.channel, gate, segment, self.data, config, group=self.group)
            self._host = (key, trainer, segment)
        return self._host[1]

    def _train(
        self, message: Message, job: _Job, cancelled: Callable[[], bool], handed: list[bool]
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
