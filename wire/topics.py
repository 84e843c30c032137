"""The versioned topic layout: every edgesplit topic starts with ``edgesplit/v1/``.

ARCHITECTURE.md has the table of topics with direction, QoS, retain flag and payload.
"""

from __future__ import annotations

import re

__all__ = [
    "PREFIX",
    "activations",
    "activations_filter",
    "announcement",
    "capabilities",
    "check_name",
    "coordinator",
    "credit",
    "credit_filter",
    "done",
    "flower_in",
    "flower_out",
    "flower_out_filter",
    "gradients",
    "presence",
    "processed",
    "servers",
    "shared",
]

PREFIX = "edgesplit/v1"
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def check_name(value: str, field: str = "name") -> str:
    """Names become topic levels: letters, digits, ``_ . -`` only (no ``/ + #``)."""
    if not _NAME.match(value):
        raise ValueError(
            f"{field}: {value!r} cannot be used in a topic; use 1-64 of A-Z a-z 0-9 _ . -"
        )
    return value


def presence(device: str) -> str:
    return f"{PREFIX}/presence/{check_name(device, 'device')}"


def capabilities(device: str) -> str:
    """An edge's retained announcement (its account alone writes it: ACL ``%u``)."""
    return f"{PREFIX}/capabilities/{check_name(device, 'device')}"


def servers(device: str) -> str:
    """A GPU server's retained announcement: apart from the edges' so that the ACL lets only
    the GPU servers' account announce the role (an edge announcing ``gpu`` on its own topic
    is not taken for a server)."""
    return f"{PREFIX}/servers/{check_name(device, 'device')}"


def announcement(device: str, role: str) -> str:
    """Where a device of ``role`` (``edge`` or ``gpu``) announces itself."""
    return servers(device) if role == "gpu" else capabilities(device)


def run_topic(run: str, kind: str, target: str | None = None) -> str:
    base = f"{PREFIX}/{check_name(run, 'run')}/{kind}"
    return base if target is None else f"{base}/{check_name(target, kind)}"


def activations(run: str, segment: str, device: str) -> str:
    """Where ``device`` streams the cut activations of ``segment`` (its own topic, for ACLs)."""
    return f"{run_topic(run, 'act', segment)}/{check_name(device, 'device')}"


def activations_filter(run: str, segment: str) -> str:
    """Every edge's stream into ``segment``; GPU servers take it as a shared subscription."""
    return f"{run_topic(run, 'act', segment)}/+"


def credit(run: str, device: str) -> str:
    return run_topic(run, "credit", device)


def gradients(run: str, device: str) -> str:
    """Backprop mode: the gradient of ``device``'s cut activations, server -> edge."""
    return run_topic(run, "grad", device)


def coordinator(run: str) -> str:
    """Retained: the session id of the coordinator process driving ``run`` (wire.session)."""
    return run_topic(run, "coordinator")


def done(run: str, device: str) -> str:
    """An edge's end of round: how many batches it sent (every GPU server hears it)."""
    return run_topic(run, "done", device)


def processed(run: str, server: str) -> str:
    """A GPU server's count of batches it trained per edge this round (for its peers)."""
    return run_topic(run, "processed", server)


def credit_filter(device: str) -> str:
    """``device``'s credits of every run."""
    return f"{PREFIX}/+/credit/{check_name(device, 'device')}"


def flower_in(node: str) -> str:
    """Flower messages to the node of device ``node`` (named, so a broker ACL can bind the
    topic to the device's account)."""
    return f"{PREFIX}/flower/{check_name(node, 'node')}/in"


def flower_out(node: str) -> str:
    """Replies of the node of device ``node`` (named, so a broker ACL binds them to the
    device's account and the coordinator knows who answered from the topic alone)."""
    return f"{PREFIX}/flower/{check_name(node, 'node')}/out"


def flower_out_filter() -> str:
    return f"{PREFIX}/flower/+/out"


def shared(group: str, topic_filter: str) -> str:
    """An MQTT v5 shared subscription: each message goes to one member of ``group``."""
    return f"$share/{check_name(group, 'group')}/{topic_filter}"
