"""The GPU server role: trains the back blocks of the model on the edges' activation streams."""

from gpu_server.chain import ChainLink
from gpu_server.stage import BackStage
from gpu_server.trainer import BackStats, BackTrainer

__all__ = ["BackStage", "BackStats", "BackTrainer", "ChainLink"]
