"""What a device's reply to a round may hold, and what the round makes of it: a device may
send anything, so a reply that is no error is checked (one weight record, numbers where
numbers belong, only the tensors it was sent, all finite) before its result counts."""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any

from flwr.app import Message

from coordinator.aggregation import WEIGHT_KEY
from coordinator.bounds import EXAMPLES_BOUND, cap_examples, foreign_tensors, server_counts
from coordinator.guard import non_finite_tensors
from coordinator.recorder import Outcome, RoundRecorder
from storage.records import DeviceResult, Event
from wire.flower import TRAINED_RECORD, numpy_arrays
from wire.logs import printable

__all__ = [
    "DIVERGED",
    "NO_REPLY",
    "bound_examples",
    "claimed_examples",
    "malformed",
    "malformed_evaluation",
    "name_failed",
    "outcome_of",
]

log = logging.getLogger(__name__)
NO_REPLY = "no reply before the deadline"  # online all the while (else: offline)
_COUNTS = ("cut-bytes-sent", "cut-bytes-received", "clients")  # stored per device, as metrics
DIVERGED = "sent weights holding NaN or infinity"  # how a device's failure says it diverged
_STORED = ("wall-seconds", "bytes-sent", "bytes-received")  # stored as sent: finite, >= 0
_REPLY_NUMBERS = ("loss", *_STORED, "peak-memory", *_COUNTS)
_LARGEST = 2.0**53  # no count or size above this is true, and a store's integer holds it


def outcome_of(
    messages: dict[str, Message],
    replies: dict[str, Message],
    started: float,
    online: set[int],
    now: float,
) -> Outcome:
    """Each device's result, the devices that trained, and the counts each reported (cut-layer
    bytes, a simulation host's clients); ``online``: the nodes online now."""
    outcome = Outcome([], [], {}, started)
    for device, message in messages.items():
        reply = replies.get(device)
        try:
            failure = _failure(message, reply, online)
        except Exception as error:  # what no check foresaw fails its device, not the round
            failure = printable(
                f"sent a reply that cannot be read ({type(error).__name__}: {error})"
            )
        if failure is None:
            outcome.results.append(_result(device, replies[device], now - started, outcome))
            outcome.ok.append(device)
        else:
            outcome.results.append(DeviceResult(device, failure=failure))
            if reply is None:
                outcome.silent.append(device)
            elif failure.startswith(DIVERGED) and not reply.has_error():
                outcome.diverged.append(device)  # found here: a device's own error cannot say so
    return outcome


def _failure(message: Message, reply: Message | None, online: set[int]) -> str | None:
    """Why the device sent ``message`` fails its round with ``reply``, or None: it trained."""
    if reply is None:
        here = message.metadata.dst_node_id in online
        return NO_REPLY if here else "offline"
    if reply.has_error():
        return printable(reply.error.reason or "failed")
    if problem := malformed(reply):
        return problem
    arrays = numpy_arrays(reply, key=None)  # decoded once: judged by what they hold
    if problem := foreign_tensors(_tensors(message), arrays):
        return problem
    if bad := non_finite_tensors(arrays):
        return (
            f"{DIVERGED} ({', '.join(bad[:3])}): its training "
            "diverged; a lower lr, or the optimizer's max_step (a bound on each step), keeps "
            "it stable"
        )
    return None


def _result(device: str, reply: Message, seconds: float, outcome: Outcome) -> DeviceResult:
    metrics = reply.content.metric_records["metrics"]
    examples = int(metrics["num-examples"])  # type: ignore[arg-type]
    reported = {  # counts: malformed() checked they are numbers; a negative one is dropped,
        name.replace("-", "_"): float(metrics.get(name, -1))  # type: ignore[arg-type]
        for name in _COUNTS
    }  # and so are more clients than examples (each client trained one at least)
    outcome.reported[device] = {
        k: v for k, v in reported.items() if 0 <= v < math.inf and (k != "clients" or v <= examples)
    }
    peak = int(metrics.get("peak-memory", -1))  # type: ignore[arg-type]
    loss = float(metrics.get("loss", math.nan))  # type: ignore[arg-type]
    return DeviceResult(
        device,
        examples=examples,
        loss=loss if math.isfinite(loss) else None,
        bytes_sent=int(metrics.get("bytes-sent", 0)),  # type: ignore[arg-type]
        bytes_received=int(metrics.get("bytes-received", 0)),  # type: ignore[arg-type]
        wall_seconds=float(metrics.get("wall-seconds", seconds)),  # type: ignore[arg-type]
        peak_memory_bytes=peak if peak >= 0 else None,
    )


def malformed_evaluation(reply: Message) -> str | None:
    metrics = reply.content.metric_records.get("metrics")
    if metrics is None:
        return "sent no metrics record"
    for name in ("num-examples", "accuracy", "loss"):
        value = metrics.get(name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"sent metric {name} {value!r}, expected a number"
        if not math.isfinite(value) or value < 0 or (name == "accuracy" and value > 1):
            return f"sent metric {name} {value!r}, out of range"
    if not float(metrics["num-examples"]) < _LARGEST:  # type: ignore[arg-type]
        # checked a number above; two claims of 1e308 sum to infinity
        return f"sent num-examples {metrics['num-examples']!r}, expected a count below 2**53"
    return None


def _tensors(message: Message) -> dict[str, Any]:
    """A message's tensors by name, undecoded (Flower's arrays: name, dtype, shape, bytes)."""
    return {k: a for record in message.content.array_records.values() for k, a in record.items()}


def malformed(reply: Message) -> str | None:
    """Why a reply that is no error cannot be used (a device may send anything), or None."""
    if len(reply.content.array_records) != 1:
        return f"sent {len(reply.content.array_records)} weight records, expected 1"
    metrics = reply.content.metric_records.get("metrics")
    if metrics is None:
        return "sent no metrics record"
    if len(reply.content.metric_records) != 1:
        return f"sent {len(reply.content.metric_records)} metric records, expected 1"
    examples = metrics.get("num-examples")
    if isinstance(examples, bool) or not isinstance(examples, int | float):
        examples = None
    if examples is None or not 0 <= examples < _LARGEST:
        return f"sent num-examples {metrics.get('num-examples')!r}, expected a count >= 0"
    for name in _REPLY_NUMBERS:
        value = metrics.get(name, 0)
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"sent metric {name} {value!r}, expected a number"
        if name in (*_STORED, "peak-memory") and not -_LARGEST < value < _LARGEST:  # also NaN
            return f"sent metric {name} {value!r}, out of range"
        if name in _STORED and value < 0:
            return f"sent metric {name} {value!r}, expected a number >= 0"
    return None


def name_failed(
    recorder: RoundRecorder, number: int, outcome: Outcome, absent: Sequence[str] = ()
) -> None:
    """A ``device-diverged`` event for each device whose weights held NaN or infinity, and a
    ``device-silent`` one for each that sent no reply (offline, or past the deadline) and
    each of the plan's edges ``absent`` (offline when the round began: sent nothing): the
    run's events show when a device was lost and for how long (a warning the first time,
    stored every round; an absent one is logged at INFO, a simulation's ``availability``
    takes clients out by design)."""
    for result in outcome.results:
        detail = f"{result.device} {result.failure}"
        if result.device in outcome.diverged:
            recorder.event(number, "device-diverged", detail, device=result.device)
        elif result.device in outcome.silent:
            recorder.event(number, "device-silent", f"{detail}: left out", device=result.device)
    if absent:  # one transaction: a thousand clients may sit a simulated round out
        said = " when the round began: left out"
        events = [Event("device-silent", f"{d} offline{said}", d, number) for d in absent]
        recorder.store.add_events(recorder.run_id, events)
        log.info("round %d: %d planned edge(s) offline%s", number, len(absent), said)


def bound_examples(
    recorder: RoundRecorder,
    strategy: Any,
    round_and_servers: tuple[int, Collection[str]],
    replies: Mapping[str, Message],
    outcome: Outcome,
) -> None:
    """Before aggregation: each edge's claimed examples (its weight) capped at what the GPU
    servers trained of it, else by its peers' claims (:func:`coordinator.bounds.cap_examples`),
    with an event. (The grid stamps each reply with the node it answers, never what it says.)
    Servers that trained more of an edge than it says it trained trained a batch twice: a
    repeat reached two of them (said, in an ``examples-repeated`` event)."""
    number, servers = round_and_servers
    records = [
        replies[d].content.config_records.get(TRAINED_RECORD) for d in outcome.ok if d in servers
    ]
    counts = server_counts(records) if servers else None
    if isinstance(counts, str):  # a trusted server, but something unusable
        recorder.event(number, "examples-capped", f"{counts}; peer-median used")
    trained = counts if isinstance(counts, dict) else None
    claims = {d: claimed_examples(replies[d]) for d in outcome.ok if d not in servers}
    for device, claimed in sorted(claims.items()):
        if trained is not None and trained.get(device, 0) > claimed:
            recorder.event(number, "examples-repeated", _repeated(device, trained, claimed))
    factor = float(getattr(strategy, "examples_bound", EXAMPLES_BOUND))
    capped = {c.device: c for c in cap_examples(claims, trained, factor)}
    for cap in capped.values():
        replies[cap.device].content.metric_records["metrics"][WEIGHT_KEY] = cap.allowed
        recorder.event(number, "examples-capped", str(cap), cap.device)
    outcome.results = [
        replace(r, examples=int(capped[r.device].allowed)) if r.device in capped else r
        for r in outcome.results
    ]


def _repeated(device: str, trained: Mapping[str, int], claimed: float) -> str:
    return (
        f"the GPU servers trained {trained[device]} examples of {device}, which trained "
        f"{claimed:.0f}: a batch of its stream reached two servers (the broker's redelivery "
        "after a server dropped, or another client publishing on its topic: see the broker's "
        "ACL, deploy/mosquitto)"
    )


def claimed_examples(reply: Message) -> float:
    return float(reply.content.metric_records["metrics"]["num-examples"])  # type: ignore[arg-type]
