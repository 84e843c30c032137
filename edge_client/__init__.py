"""The edge device agent: trains its front segment with a local loss and streams the cut."""

from edge_client.source import OwnSegment, SegmentLease, SegmentSource
from edge_client.trainer import EdgeRoundReport, EdgeTrainer, EdgeTrainerConfig

__all__ = [
    "EdgeRoundReport",
    "EdgeTrainer",
    "EdgeTrainerConfig",
    "OwnSegment",
    "SegmentLease",
    "SegmentSource",
]
