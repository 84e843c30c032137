"""What a device's Flower message asks of it: the task with its sections parsed, and the
round's options the coordinator or the strategy add (FedProx's weight, the try, the batch
order, a bound on the steps)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass

from flwr.app import Context, Error, Message

from split_models.config import ModelConfig, TrainingConfig
from split_models.errors import ConfigError
from split_models.sections import task_sections
from wire.errors import WireError
from wire.flower import attempt_of, max_step_of, order_of, proximal_mu_of
from wire.roles import Task

__all__ = ["Job", "job_of", "with_job"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    """A message's task with its sections parsed."""

    task: Task
    model: ModelConfig
    training: TrainingConfig
    proximal_mu: float = 0.0  # FedProx's, from the strategy's train message
    attempt: int = 1  # the coordinator's try of the round
    order: int = 1  # the batch order it draws (wire.flower.order_of)
    # a bound on each step of the blocks (not the head) this round (wire.flower.max_step_of):
    # an edge's first round at a new cut, whose blocks the GPU servers trained under their own
    max_step: float | None = None


def job_of(message: Message, models: Collection[str]) -> Job:
    """The task of ``message``; raises ``WireError``/``ConfigError`` naming the bad field
    (or a model outside the zoo and ``models``)."""
    task = Task.parse(str(message.content.config_records["config"]["task"]))
    train = message.metadata.message_type == "train"
    mu, attempt = (proximal_mu_of(message), attempt_of(message)) if train else (0.0, 1)
    order, bound = (order_of(message), max_step_of(message)) if train else (1, None)
    sections = task_sections(task.model, task.training, models)
    return Job(task, *sections, mu, attempt, order, bound)


def with_job(
    handle: Callable[[Message, Job], Message], models: Collection[str]
) -> Callable[[Message, Context], Message]:
    """A Flower handler that parses the message's task once and passes it to ``handle``; a
    task that does not parse is answered with an error naming the bad field."""

    def handler(message: Message, _context: Context) -> Message:
        try:
            job = job_of(message, models)
        except (WireError, ConfigError) as error:
            log.warning("rejected a task: %s", error)
            return Message(Error(code=3, reason=f"bad task: {error}"), reply_to=message)
        return handle(message, job)

    return handler
