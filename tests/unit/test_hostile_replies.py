"""A reply that is no error but cannot be used (a device may send anything) fails that device
by name; it never raises inside the coordinator."""

from __future__ import annotations

import io
from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from coordinator.recorder import Outcome
from coordinator.replies import (
    DIVERGED,
    _result,
    malformed,
    malformed_evaluation,
    name_failed,
    outcome_of,
)
from wire.flower import array_record

pytestmark = pytest.mark.unit


def _reply(metrics: dict[str, object] | None, records: int = 1) -> object:
    content = RecordDict(
        {f"arrays{i}": array_record({"w": np.zeros(2, np.float32)}) for i in range(records)}
    )
    if metrics is not None:
        content["metrics"] = MetricRecord(metrics)  # type: ignore[arg-type]
    return SimpleNamespace(content=content)


@pytest.mark.parametrize(
    ("reply", "why"),
    [
        (_reply(None), "no metrics record"),
        (_reply({"loss": 1.0}), "num-examples None"),
        (_reply({"num-examples": -5}), "num-examples -5"),
        (_reply({"num-examples": float("nan")}), "num-examples nan"),
        (_reply({"num-examples": 4}, records=2), "2 weight records"),
        (_reply({"num-examples": 4}, records=0), "0 weight records"),
        (_reply({"num-examples": 4, "clients": [3, 4]}), "metric clients [3, 4]"),
        (_reply({"num-examples": 4, "cut-bytes-sent": [1]}), "metric cut-bytes-sent"),
    ],
)
def test_an_unusable_train_reply_names_what_is_wrong(reply: object, why: str) -> None:
    problem = malformed(reply)  # type: ignore[arg-type]
    assert problem is not None and why in problem


def test_a_good_reply_passes_and_evaluation_replies_are_checked_too() -> None:
    assert malformed(_reply({"num-examples": 4, "loss": 0.5})) is None  # type: ignore[arg-type]
    good = _reply({"num-examples": 4, "accuracy": 0.5, "loss": 1.0})
    assert malformed_evaluation(good) is None  # type: ignore[arg-type]
    lying = _reply({"num-examples": 4, "accuracy": 7.0, "loss": 1.0})
    assert "out of range" in str(malformed_evaluation(lying))  # type: ignore[arg-type]
    assert "no metrics" in str(malformed_evaluation(_reply(None)))  # type: ignore[arg-type]
    huge = _reply({"num-examples": 1e308, "accuracy": 0.5, "loss": 1.0})  # two sum to inf
    assert "below 2**53" in str(malformed_evaluation(huge))  # type: ignore[arg-type]


def test_counts_a_reply_reports_are_kept_only_when_they_are_counts() -> None:
    outcome = Outcome(results=[], ok=[])
    honest = _reply({"num-examples": 4, "clients": 3, "cut-bytes-sent": 100})
    lying = _reply({"num-examples": 4, "clients": -3, "cut-bytes-sent": float("inf")})
    boasting = _reply({"num-examples": 4, "clients": 5})  # more clients than examples
    for device, reply in [("host-0", honest), ("host-1", lying), ("host-2", boasting)]:
        _result(device, reply, 1.0, outcome)  # type: ignore[arg-type]

    assert outcome.reported == {
        "host-0": {"clients": 3.0, "cut_bytes_sent": 100.0},
        "host-1": {},
        "host-2": {},
    }


def test_finite_activations_large_enough_to_overflow_the_back_are_refused() -> None:
    import torch

    from gpu_server.stage import BackStage
    from split_models.zoo import build_model
    from wire.codec import Envelope
    from wire.errors import WireError

    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    stage = BackStage(model, 1, model.num_blocks)
    spec = stage.cut_specs[1][0]
    x = np.full((4, *spec.shape[1:]), 3e38, dtype=np.float32)
    y = np.zeros(4, dtype=np.int64)
    before = [p.detach().clone() for p in stage.segment.module.parameters()]
    with pytest.raises(WireError, match="magnitude 3e\\+38"):
        stage.train(Envelope("activations", "r", "pi-01", 0, 1, {"cut": 1}, {"x": x, "y": y}))
    # just under the bound but still overflowing: the loss is not finite, no step is taken
    with torch.no_grad():
        for p in stage.segment.module.parameters():
            p.fill_(1e30)
    poisoned = [p.detach().clone() for p in stage.segment.module.parameters()]
    x = np.full((4, *spec.shape[1:]), 1e7, dtype=np.float32)
    with pytest.raises(WireError, match="not trained"):
        stage.train(Envelope("activations", "r", "pi-01", 1, 1, {"cut": 1}, {"x": x, "y": y}))
    for p, q in zip(stage.segment.module.parameters(), poisoned, strict=True):
        assert torch.equal(p, q)  # untouched by the bad batch
    assert before  # the segment has weights


def test_passwords_never_reach_a_log_line_or_an_error() -> None:
    from wire.mqtt import MqttConfig, redact_url

    assert redact_url("mqtts://pi-01:s3cret@broker:8883") == "mqtts://pi-01:***@broker:8883"
    assert redact_url("postgresql+psycopg://edgesplit:pw@db/runs") == (
        "postgresql+psycopg://edgesplit:***@db/runs"
    )
    assert redact_url("mqtt://127.0.0.1:1883") == "mqtt://127.0.0.1:1883"
    with pytest.raises(ValueError) as error:
        MqttConfig.from_url("tcp://pi-01:s3cret@broker:1883")
    assert "s3cret" not in str(error.value) and "***" in str(error.value)


@pytest.mark.parametrize(
    ("metrics", "why"),
    [
        ({"bytes-sent": float("inf")}, "metric bytes-sent inf, out of range"),
        ({"bytes-sent": 1e30}, "metric bytes-sent 1e+30, out of range"),
        ({"bytes-received": -1}, "metric bytes-received -1, expected a number >= 0"),
        ({"wall-seconds": float("nan")}, "metric wall-seconds nan, out of range"),
        ({"wall-seconds": -2.0}, "metric wall-seconds -2.0, expected a number >= 0"),
        ({"peak-memory": float("nan")}, "metric peak-memory nan, out of range"),
        ({"num-examples": 1e30}, "num-examples 1e+30"),
    ],
)
def test_numbers_a_store_would_refuse_fail_the_device(metrics: dict[str, object], why: str) -> None:
    problem = malformed(_reply({"num-examples": 4, **metrics}))  # type: ignore[arg-type]
    assert problem is not None and why in problem
    honest = {"num-examples": 4, "peak-memory": -1, "loss": float("nan"), "bytes-sent": 0}
    assert malformed(_reply(honest)) is None  # type: ignore[arg-type]  # -1: not measured


def test_a_second_metric_record_fails_the_device() -> None:
    reply = _reply({"num-examples": 4})
    reply.content["extra"] = MetricRecord({"x": 1})  # type: ignore[attr-defined]
    assert malformed(reply) == "sent 2 metric records, expected 1"  # type: ignore[arg-type]


GIVEN = {"block1.w": np.ones((2, 2), np.float32)}


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _forged(**fields: object) -> Array:
    return Array(**{"dtype": "float32", "shape": (2, 2), "stype": "numpy.ndarray", **fields})


HOSTILE = {
    "garbage bytes": _forged(data=b"garbage"),
    "another stype": _forged(stype="torch", data=_npy(GIVEN["block1.w"])),
    "no bytes": _forged(data=b""),
    "a header claiming 2**50 floats": _forged(data=_npy(np.ones(2, np.float32))[:10] + b"x" * 118),
    "a header for 2**50 floats": _forged(
        data=_npy(np.ones(2, np.float32)).replace(b"(2,)", b"(1125899906842624,)")
    ),
    "bytes holding another shape": _forged(data=_npy(np.ones((3, 3), np.float32))),
    "another dtype": _forged(dtype="int64", data=_npy(np.full((2, 2), 1000, np.int64))),
    "an integer tensor declared float": _forged(data=_npy(np.full((2, 2), 1000, np.int64))),
    "complex NaN": _forged(dtype="complex64", data=_npy(np.full((2, 2), np.nan, np.complex64))),
}


def test_weights_that_do_not_decode_to_what_was_given_fail_that_device_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for field in ("_run_id", "_node_id", "_task_id"):  # a grid sets them; no grid here
        monkeypatch.setattr(TaskIdentity, field, 1)
    messages, replies = {}, {}
    for node, (device, array) in enumerate([("honest", None), *HOSTILE.items()], start=1):
        message = Message(RecordDict({"arrays": array_record(GIVEN)}), node, "train")
        messages[device] = message
        arrays = array_record(GIVEN) if array is None else ArrayRecord({"block1.w": array})
        content = RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 4})})
        replies[device] = Message(content, reply_to=message)

    outcome = outcome_of(messages, replies, 0.0, set(), 1.0)  # type: ignore[arg-type]

    assert outcome.ok == ["honest"]
    failures = {r.device: r.failure for r in outcome.results if r.failure}
    assert set(failures) == set(HOSTILE)
    assert "shape [3, 3], it was given [2, 2]" in failures["bytes holding another shape"]
    assert "as int64, it was given float32" in failures["another dtype"]
    assert "as int64, it was given float32" in failures["an integer tensor declared float"]
    assert "cannot be read" in failures["a header for 2**50 floats"]
    assert all(len(why) <= 500 for why in failures.values())


def test_only_weights_that_hold_nan_make_a_device_diverged_not_its_own_word(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A device whose error reason copies the divergence text was named in a
    ``device-diverged`` event (with a lower-lr advice) though it sent no weights."""
    for field in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, field, 1)
    nan = {name: np.full_like(value, np.nan) for name, value in GIVEN.items()}
    messages, replies = {}, {}
    for node, device in enumerate(("nan", "liar"), start=1):
        messages[device] = Message(RecordDict({"arrays": array_record(GIVEN)}), node, "train")
    content = RecordDict(
        {"arrays": array_record(nan), "metrics": MetricRecord({"num-examples": 4})}
    )
    replies["nan"] = Message(content, reply_to=messages["nan"])
    said = Error(code=1, reason=f"{DIVERGED} (everything): {'x' * 400}")
    replies["liar"] = Message(said, reply_to=messages["liar"])

    messages["gone"] = Message(RecordDict({"arrays": array_record(GIVEN)}), 3, "train")

    outcome = outcome_of(messages, replies, 0.0, {3}, 1.0)  # type: ignore[arg-type]

    assert outcome.ok == [] and outcome.diverged == ["nan"] and outcome.silent == ["gone"]
    events: list[tuple[str, str, str | None]] = []
    stored: list[tuple[str, str, str | None]] = []
    store = SimpleNamespace(
        add_events=lambda _run, added: stored.extend((e.kind, e.detail, e.device) for e in added)
    )
    recorder = SimpleNamespace(
        event=lambda _n, kind, detail, device: events.append((kind, detail, device)),
        store=store,
        run_id="r1",
    )
    name_failed(recorder, 1, outcome, absent=["away"])  # type: ignore[arg-type]
    events += stored
    assert [(kind, device) for kind, _, device in events] == [
        ("device-diverged", "nan"),
        ("device-silent", "gone"),
        ("device-silent", "away"),
    ]
    assert events[1][1] == "gone no reply before the deadline: left out"
    assert events[2][1] == "away offline when the round began: left out"


def test_a_device_claiming_huge_test_data_does_not_set_the_federated_accuracy_alone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from flwr.serverapp.strategy import FedAvg

    from coordinator.runner import _bound_evaluation

    for field in ("_run_id", "_node_id", "_task_id"):  # a grid sets them; no grid here
        monkeypatch.setattr(TaskIdentity, field, 1)

    def evaluated(examples: int, accuracy: float) -> Message:
        metrics = {"num-examples": examples, "accuracy": accuracy, "loss": 1.0 - accuracy}
        return Message(RecordDict({"metrics": MetricRecord(metrics)}), 1, "evaluate")  # type: ignore[arg-type]

    replies = {"a": evaluated(100, 0.9), "b": evaluated(120, 0.92), "c": evaluated(110, 0.91)}
    honest = FedAvg().aggregate_evaluate(1, list(replies.values()))
    replies["liar"] = evaluated(10**12, 0.0)

    _bound_evaluation(replies, 10.0)
    judged = FedAvg().aggregate_evaluate(1, list(replies.values()))

    assert replies["liar"].content.metric_records["metrics"]["num-examples"] == 1100
    assert judged is not None and honest is not None
    # weighted by 1100 (10x its peers' median) instead of 1e12: its share of the mean is
    # 1100 / 1430, no longer 1 - 3e-10 (the bound's share among n devices: 10 / (10 + n - 1))
    assert judged["accuracy"] == pytest.approx((90 + 110.4 + 100.1) / 1430)
    assert judged["accuracy"] < honest["accuracy"], "its capped claim still counts"
    assert "liar claimed 1000000000000 examples; weighted by 1100" in caplog.text
    untouched = {"a": evaluated(100, 0.9), "b": evaluated(120, 0.92)}
    _bound_evaluation(untouched, 0.0)  # the bound off (examples_bound: 0)
    assert untouched["a"].content.metric_records["metrics"]["num-examples"] == 100


FORGED = "no room\n2026-12-07 15:00:00  run-finished  FORGED\x1b]0;pwned\x07\x1b[2J\u202e"


def test_a_devices_text_cannot_forge_a_log_line_or_drive_the_terminal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reason a device sends reaches logs, events and `runs events` with its control
    characters escaped: a newline in it printed a forged line, escapes drove the terminal."""
    from coordinator.planner import _answer
    from coordinator.run_commands import format_event
    from storage.records import Event
    from wire.logs import printable

    for field in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, field, 1)
    asked = Message(RecordDict({"arrays": array_record(GIVEN)}), 1, "train")
    failed = outcome_of(
        {"liar": asked}, {"liar": Message(Error(1, FORGED), reply_to=asked)}, 0.0, {1}, 1.0
    )  # type: ignore[arg-type]
    refused = Message(
        RecordDict(
            {
                "metrics": MetricRecord({"accepted": 0, "budget": 1}),
                "answer": ConfigRecord({"reason": FORGED}),
            }
        ),
        reply_to=asked,
    )
    answer = _answer(refused)
    assert answer is not None
    for text in (failed.results[0].failure, answer[2], format_event(Event("refused", FORGED))):
        assert text is not None and text.isprintable(), text
        assert "no room\\n2026-12-07" in text and "\\x1b]0;pwned\\x07\\x1b[2J\\u202e" in text
    assert printable("plain words, kept") == "plain words, kept"
    assert len(printable("x" * 900)) == 500


class _Events:
    def __init__(self) -> None:
        self.said: list[tuple[str, str, str | None]] = []

    def event(self, _number: int, kind: str, detail: str, device: str | None = None) -> None:
        self.said.append((kind, detail, device))


def _trained(examples: int, counts: dict[str, int] | None = None) -> object:
    content = RecordDict({"metrics": MetricRecord({"num-examples": examples})})
    if counts is not None:
        content["trained"] = ConfigRecord(counts)  # type: ignore[arg-type]
    return SimpleNamespace(content=content)


def test_servers_training_more_of_an_edge_than_it_trained_is_said() -> None:
    """Two GPU servers sharing an edge's stream each dropped only the repeats they had seen:
    a batch reaching both was trained twice, silently (an operator's trial: 95 of 94)."""
    from coordinator.replies import bound_examples

    replies = {
        "e0": _trained(320),
        "e1": _trained(320),
        "gpu-a": _trained(0, {"e0": 160, "e1": 192}),
        "gpu-b": _trained(0, {"e0": 160, "e1": 160}),
    }
    outcome = Outcome([], sorted(replies))
    events = _Events()
    bound_examples(events, None, (2, {"gpu-a", "gpu-b"}), replies, outcome)  # type: ignore[arg-type]
    repeated = [detail for kind, detail, _ in events.said if kind == "examples-repeated"]
    assert repeated == [
        "the GPU servers trained 352 examples of e1, which trained 320: a batch of its stream "
        "reached two servers (the broker's redelivery after a server dropped, or another client "
        "publishing on its topic: see the broker's ACL, deploy/mosquitto)"
    ], events.said
    assert not [kind for kind, _, _ in events.said if kind == "examples-capped"]
