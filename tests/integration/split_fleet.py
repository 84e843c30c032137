"""A small federated split fleet for tests: the real agents of a deployment (one GPU server
agent and two edge agents with different cuts) on the given transport factory, a grid that
hands each node its :class:`~wire.roles.Task` in every message (as the coordinator does), and
held-out accuracy of a weight set."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from edge_client.agent import EdgeAgent
from gpu_server.agent import GpuAgent
from gpu_server.trainer import BackTrainer
from split_models import Dataset, OptimizerConfig, Segment, build_model, partition
from split_models.config import ModelConfig, TrainingConfig, config_to_dict
from split_models.evaluation import evaluate_weights
from split_models.weights import segment_state
from wire.flower import FlowerNode, node_will
from wire.roles import Announcement, Task, node_id_for
from wire.transport import Transport

EDGES = {"pi-01": 1, "pi-02": 2}  # device -> cut
GPU = "gpu-a"
OPTIMIZER = OptimizerConfig("sgd-momentum", lr=0.02)
MODEL = ("cnn", (1, 28, 28), 10)
DEADLINE = 120.0
Connect = Callable[..., Transport]


@dataclass
class Fleet:
    gpu: GpuAgent
    nodes: list[FlowerNode]
    initial: dict[str, np.ndarray]  # every device's starting tensors under global names
    tasks: dict[int, Task]  # by Flower node id
    run: str

    @property
    def back(self) -> BackTrainer:
        """The GPU server's trainer of the run (it exists once a round was sent)."""
        trainer = self.gpu.trainer(self.run)
        if trainer is None:
            raise LookupError(f"the GPU server has not trained run {self.run!r} yet")
        return trainer

    @property
    def node_ids(self) -> list[int]:
        return sorted(self.tasks)

    def grid(self, grid: Grid) -> Grid:
        """``grid`` with every message carrying its node's task."""
        return TaskGrid(grid, self.tasks)


def _task(run: str, start: int, end: int, edges: tuple[str, ...] = ()) -> Task:
    model = ModelConfig(*MODEL)
    training = TrainingConfig(
        rounds=1, batch_size=32, optimizer=OPTIMIZER, round_deadline_seconds=DEADLINE
    )
    return Task(
        run=run,
        model=config_to_dict(model),
        training=training.to_dict(),
        start=start,
        end=end,
        edges=edges,
    )


def start_fleet(
    connect: Connect, train: Dataset, run: str, data: Mapping[str, Dataset] | None = None
) -> Fleet:
    """GPU server (blocks from the shallowest cut) and the edges, all online as Flower nodes;
    the edges share ``train`` (or train on their own ``data``, by device)."""
    model = build_model(*MODEL, seed=0)
    start = min(EDGES.values())
    gpu = GpuAgent(
        Announcement(GPU, "gpu", 1 << 34, 1e12),
        connect(f"{GPU}-control", node_will(node_id_for(GPU), GPU)),
        connect(f"{GPU}-stream"),
    )
    tasks = {node_id_for(GPU): _task(run, start, model.num_blocks, tuple(EDGES))}
    initial = segment_state(Segment.from_model(model, start, model.num_blocks))
    nodes = [gpu.node]
    for (device, cut), rows in zip(EDGES.items(), partition(train.y, 2, seed=0), strict=True):
        agent = EdgeAgent(
            Announcement(device, "edge", 1 << 32, 1e9, 1e7),
            train.subset(rows) if data is None else data[device],
            connect(f"{device}-control", node_will(node_id_for(device), device)),
            connect(f"{device}-stream"),
            measure_peak=False,
        )
        nodes.append(agent.node)
        tasks[node_id_for(device)] = _task(run, 0, cut)
        initial |= segment_state(Segment.from_model(build_model(*MODEL, seed=0), 0, cut))
    return Fleet(gpu, nodes, initial, tasks, run)


class TaskGrid(Grid):
    """A grid whose messages each carry the task of the node they go to."""

    def __init__(self, grid: Grid, tasks: Mapping[int, Task]) -> None:
        self._grid, self._tasks = grid, tasks

    def _with_task(self, message: Message) -> Message:
        node = message.metadata.dst_node_id
        config = ConfigRecord(
            {**message.content.config_records["config"], "task": self._tasks[node].to_json()}
        )
        content = RecordDict({**message.content.array_records, "config": config})
        return self._grid.create_message(
            content, message.metadata.message_type, node, message.metadata.group_id
        )

    def set_run(self, run: Any) -> None:
        self._grid.set_run(run)

    @property
    def run(self) -> Any:
        return self._grid.run

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        return self._grid.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        return self._grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self._grid.push_messages([self._with_task(m) for m in messages])

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._grid.pull_messages(message_ids)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return self._grid.send_and_receive([self._with_task(m) for m in messages], timeout=timeout)

    def abandon(self, message_ids: Iterable[str]) -> None:
        self._grid.abandon(message_ids)  # type: ignore[attr-defined]


def accuracy(weights: Mapping[str, np.ndarray], test: Dataset) -> float:
    """Held-out accuracy of the whole model assembled from ``weights``."""
    return evaluate_weights(ModelConfig("cnn", (1, 28, 28), 10), weights, test)["accuracy"]
