"""The GPU server's Flower ``ClientApp``: a round loads the back weights, opens the edges'
credit windows, and answers once every edge's last batch of the round has been trained."""

from __future__ import annotations

from collections.abc import Sequence

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from gpu_server.trainer import BackTrainer
from wire.flower import array_record, numpy_arrays, round_of

__all__ = ["gpu_app"]


def gpu_app(back: BackTrainer, devices: Sequence[str], round_timeout: float) -> ClientApp:
    """A ClientApp serving one round per ``train`` message for the edges in ``devices``."""
    app = ClientApp()

    @app.train()
    def train(message: Message, _context: Context) -> Message:
        weights = numpy_arrays(message)
        round_number = round_of(message)
        back.begin_round(round_number, devices, weights)
        examples, loss = back.wait_round(devices, round_timeout)
        metrics = MetricRecord({"num-examples": examples, "loss": loss})
        content = RecordDict({"arrays": array_record(back.state()), "metrics": metrics})
        return Message(content, reply_to=message)

    return app
