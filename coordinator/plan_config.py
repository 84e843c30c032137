"""What a plan is made for (batch, optimizer, local loss, compression), without torch: the
command line reads its defaults at start. :mod:`coordinator.partitioner` makes the plan."""

from __future__ import annotations

from dataclasses import dataclass

from split_models.errors import ConfigError
from split_models.options import LOCAL_LOSSES, OPTIMIZERS

__all__ = ["COMPRESSION_BYTES", "CUTS", "ENCODE_WORK", "PartitionConfig"]

_MODES = ("local-loss", "backprop")  # split_models.config.MODES, without importing torch
COMPRESSION_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0}
# the codec's working copy while it compresses a batch (``wire.codec``), as a share of the
# batch's fp32 activations: bf16 rounds in one uint32 copy, int8 quantises in one float32 copy
ENCODE_WORK = {"fp32": 0.0, "fp16": 0.0, "bf16": 1.0, "int8": 1.0}
# per-device: each edge its own cut; uniform: one cut for every edge (the classic SplitFed
# set-up, and the baseline per-device cuts are measured against)
CUTS = ("per-device", "uniform")


@dataclass(frozen=True)
class PartitionConfig:
    """What the plan is for: training batch, optimizer, local loss and cut compression."""

    batch_size: int = 64
    optimizer: str = "sgd-momentum"
    local_loss: str = "linear"
    compression: str = "fp32"
    min_edge_blocks: int = 1
    cuts: str = "per-device"
    anchor: bool = False  # FedProx: each device keeps a copy of the round's weights
    mode: str = "local-loss"  # backprop (splitfed): no head; the output's gradient comes back

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"batch_size: must be >= 1, got {self.batch_size}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer: unknown {self.optimizer!r}; use one of {OPTIMIZERS}")
        if self.local_loss not in LOCAL_LOSSES:
            raise ConfigError(f"local_loss: unknown {self.local_loss!r}; use one of {LOCAL_LOSSES}")
        if self.compression not in COMPRESSION_BYTES:
            raise ConfigError(
                f"compression: unknown {self.compression!r}; use one of {list(COMPRESSION_BYTES)}"
            )
        if self.min_edge_blocks < 1:
            raise ConfigError(f"min_edge_blocks: must be >= 1, got {self.min_edge_blocks}")
        if self.cuts not in CUTS:
            raise ConfigError(f"cuts: unknown {self.cuts!r}; use one of {list(CUTS)}")
        if self.mode not in _MODES:
            raise ConfigError(f"mode: unknown {self.mode!r}; use one of {list(_MODES)}")

    @property
    def head(self) -> str | None:
        """The local head an edge segment trains with: none in backprop mode, whose
        segments keep the gradient of their output instead (the memory estimate's choice)."""
        return None if self.mode == "backprop" else self.local_loss
