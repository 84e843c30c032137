"""Errors of the wire layer. A ``WireError`` carries a short machine-readable reason."""

from __future__ import annotations

__all__ = ["RefusedError", "TransportClosed", "TransportError", "UnreachableError", "WireError"]


class WireError(ValueError):
    """An inbound message was rejected; ``reason`` is a short tag used in metrics."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class TransportError(RuntimeError):
    """The transport cannot do what was asked (not connected, payload too large...)."""


class UnreachableError(TransportError):
    """The MQTT broker cannot be reached (not running, wrong host or port, firewall)."""


class RefusedError(TransportError):
    """The MQTT broker refused this client: its account, password or name (an ACL lets a
    device account write only under its own name)."""


class TransportClosed(TransportError):
    """The transport was closed (its process is shutting down): a handler that still tries to
    publish on it stops, which is no fault."""
