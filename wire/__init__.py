"""The wire protocol shared by all edgesplit roles: topics, envelopes, transports, Flower.

Torch-free: tensors are numpy arrays here, converted at the edge of each role.
"""

from wire.channel import Channel, ChannelStats, Rejection
from wire.codec import ENCODINGS, KINDS, Envelope, TensorSpec, decode, encode
from wire.errors import TransportError, WireError
from wire.stream import StreamServer, StreamStats
from wire.transport import InProcessHub, InProcessTransport, Transport, Will

__all__ = [
    "ENCODINGS",
    "KINDS",
    "Channel",
    "ChannelStats",
    "Envelope",
    "InProcessHub",
    "InProcessTransport",
    "Rejection",
    "StreamServer",
    "StreamStats",
    "TensorSpec",
    "Transport",
    "TransportError",
    "Will",
    "WireError",
    "decode",
    "encode",
]
