"""The edge's Flower ``ClientApp``: each ``train`` message is one round of local training.

The message carries the global weights (the edge loads the tensors of its own segment) and the
round number; the reply carries the segment's trained tensors under their global names and the
examples trained, which weight its share in aggregation.
"""

from __future__ import annotations

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from edge_client.trainer import EdgeTrainer
from split_models.weights import load_segment_state, segment_state
from wire.flower import array_record, numpy_arrays, round_of

__all__ = ["edge_app"]


def edge_app(trainer: EdgeTrainer) -> ClientApp:
    """A ClientApp that trains ``trainer``'s segment for one round per ``train`` message."""
    app = ClientApp()

    @app.train()
    def train(message: Message, _context: Context) -> Message:
        weights = numpy_arrays(message)
        load_segment_state(trainer.segment, weights)
        trainer.segment.reset_optimizer()
        round_number = round_of(message)
        report = trainer.train_round(round_number)
        metrics = MetricRecord({"num-examples": report.examples, "loss": report.mean_loss})
        content = RecordDict(
            {"arrays": array_record(segment_state(trainer.segment)), "metrics": metrics}
        )
        return Message(content, reply_to=message)

    return app
