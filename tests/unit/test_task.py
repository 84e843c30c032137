"""The round's task: it carries the run's model and training sections as plain data that
``Task.parse`` checks for shape, the agents parse them with ``split_models.config`` (a bad one
is an error reply naming the field), and one ``segment_key`` says which tasks can share a
built segment."""

from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, RecordDict

from coordinator.assignments import Assignment, build_task
from coordinator.config import RunConfig
from edge_client.agent import EdgeAgent
from gpu_server.agent import GpuAgent
from split_models.config import ModelConfig, TrainingConfig, config_to_dict, parse_config
from split_models.data import Dataset
from split_models.segment import OptimizerConfig
from wire.errors import WireError
from wire.flower import TransportGrid
from wire.roles import MAX_SECTION_BYTES, Announcement, Task, node_id_for
from wire.transport import InProcessHub, InProcessTransport

pytestmark = pytest.mark.unit

MODEL = ModelConfig("mlp", (1, 8, 8), 10)
TRAINING = TrainingConfig(rounds=3, batch_size=16, optimizer=OptimizerConfig("adam", lr=0.001))


def _task(**changes: object) -> Task:
    task = Task(
        run="r1",
        model=config_to_dict(MODEL),
        training=TRAINING.to_dict(),
        start=0,
        end=2,
        estimated_peak_bytes=1 << 20,
        edges=("pi-01",),
        servers=("gpu-a", "gpu-b"),
        forward="seg-1",
        session="s-1",
    )
    return dataclasses.replace(task, **changes)  # type: ignore[arg-type]


def test_a_task_round_trips_through_json_and_its_sections_parse_back() -> None:
    task = _task()
    again = Task.parse(task.to_json())
    assert again == task
    assert parse_config(ModelConfig, again.model) == MODEL
    assert TrainingConfig.parse(again.training) == TRAINING
    bare = Task.parse(_task(edges=(), servers=(), forward=None, session=None).to_json())
    assert bare.forward is None and bare.session is None and bare.segment == "seg-0"


def test_a_text_seen_lately_is_parsed_once_and_a_bad_one_every_time() -> None:
    """The clients of one cut get the same task text: parsed once. A bad text is never kept."""
    text = _task(start=1, end=3).to_json()
    assert Task.parse(text) is Task.parse(text) == _task(start=1, end=3)
    bad = _task(start=3, end=3).to_json()
    for _ in range(2):
        with pytest.raises(WireError, match="empty"):
            Task.parse(bad)


def test_build_task_sends_the_run_sections_as_they_are() -> None:
    config = RunConfig.parse(
        {
            "run_id": "r",
            "model": "mlp",
            "input_shape": [1, 8, 8],
            "num_classes": 10,
            "devices": {"edges": ["pi-01"]},
            "rounds": 2,
            "federated_eval": 0.25,
        }
    )
    back = build_task(
        config,
        Assignment("gpu-a", 1, 3, 5, "gpu"),
        "s",
        server_route=(["pi-01"], [], "seg-0", None),
    )
    edge = build_task(config, Assignment("pi-01", 0, 1, 7, "edge"), "s")
    assert parse_config(ModelConfig, edge.model) == config.model
    assert TrainingConfig.parse(edge.training) == config.training
    assert edge.training["federated_eval"] == 0.25 and edge.session == "s"
    assert (back.edges, back.servers, back.forward, back.estimated_peak_bytes) == (
        ("pi-01",),
        (),
        None,
        5,
    )


def _raw(section: str, value: object) -> str:
    data = json.loads(_task().to_json())
    data[section] = value
    return json.dumps(data)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (_raw("model", "mlp"), "task.model: expected a JSON object"),
        (_raw("training", [1, 2]), "task.training: expected a JSON object"),
        (_raw("training", {"note": "x" * MAX_SECTION_BYTES}), "exceeds"),
        (_raw("training", {str(k): k for k in range(100)}), "keys exceeds"),
        (_raw("training", {"optimizer": {"name": {"deep": 1}}}), "one object deep"),
        (_raw("model", {"input_shape": [{"a": 1}]}), "task.model.input_shape"),
        (_raw("model", {"": "mlp"}), "keys are names"),
        (_raw("model", {"k" * 65: "mlp"}), "keys are names"),
        (_raw("training", {"lr": float("nan")}), "task.training.lr"),
        (_raw("start", 3), "blocks [3, 2) are empty"),
        (_raw("servers", "gpu-a"), "task.servers"),
        (_raw("forward", 1), "task.forward"),
        (_raw("extra", {}), "unknown key(s) ['extra']"),
    ],
)
def test_a_malformed_task_is_rejected(payload: str, message: str) -> None:
    with pytest.raises(WireError) as error:
        Task.parse(payload)
    assert message in str(error.value)


def _edge_agent(hub: InProcessHub) -> EdgeAgent:
    rng = np.random.default_rng(0)
    data = Dataset(rng.normal(size=(8, 1, 8, 8)).astype(np.float32), np.arange(8) % 10, 10)
    return EdgeAgent(
        Announcement("pi-01", "edge", 1 << 32, 1e9, 1e7),
        data,
        InProcessTransport(hub, "pi-01-control"),
        InProcessTransport(hub, "pi-01-stream"),
        measure_peak=False,
    )


def _gpu_agent(hub: InProcessHub) -> GpuAgent:
    return GpuAgent(
        Announcement("gpu-a", "gpu", 1 << 32, 1e9),
        InProcessTransport(hub, "gpu-a-control"),
        InProcessTransport(hub, "gpu-a-stream"),
    )


def test_an_edge_agent_answers_a_bad_training_section_with_the_field() -> None:
    hub = InProcessHub()
    agent = _edge_agent(hub)
    task = _task(training={**TRAINING.to_dict(), "batch_size": 0})
    config = ConfigRecord({"task": task.to_json(), "server-round": 1})
    grid = TransportGrid(InProcessTransport(hub, "coordinator"))
    message = grid.create_message(
        RecordDict({"config": config}), "train", node_id_for("pi-01"), "edgesplit"
    )
    context = Context(1, node_id_for("pi-01"), {}, RecordDict(), {})
    reply = agent.client_app()(message, context)
    assert reply.has_error()
    assert "task.training.batch_size" in reply.error.reason, reply.error.reason
    assert "got 0" in reply.error.reason


def test_the_segment_key_ignores_bookkeeping_but_not_what_shapes_the_segment() -> None:
    base = _task()
    later = TrainingConfig(
        rounds=9,
        batch_size=16,
        optimizer=TRAINING.optimizer,
        round_deadline_seconds=30.0,
        seed=4,
    )
    bookkeeping = _task(
        session="s-2", estimated_peak_bytes=1, training=later.to_dict(), segment="seg-3"
    )
    other_optimizer = TrainingConfig(rounds=3, batch_size=16, optimizer=OptimizerConfig("sgd"))
    assert bookkeeping.segment_key() == base.segment_key()
    assert _task(end=3).segment_key() != base.segment_key()
    assert _task(training=other_optimizer.to_dict()).segment_key() != base.segment_key()
    assert _task(forward=None).segment_key() != base.segment_key()  # the last piece: no head
    backprop = dataclasses.replace(TRAINING, mode="backprop")
    assert _task(training=backprop.to_dict()).segment_key() != base.segment_key()


def _reply_to(
    agent: object, hub: InProcessHub, task: Task, device: str, kind: str = "train"
) -> object:
    config = ConfigRecord({"task": task.to_json(), "server-round": 1})
    grid = TransportGrid(InProcessTransport(hub, "coordinator"))
    message = grid.create_message(
        RecordDict({"config": config}), kind, node_id_for(device), "edgesplit"
    )
    context = Context(1, node_id_for(device), {}, RecordDict(), {})
    return agent.client_app()(message, context)  # type: ignore[attr-defined]


@pytest.mark.parametrize("model", ["os:abort", "subprocess:run", "tests.fixtures.gallery:lenet"])
def test_no_task_makes_an_agent_import_a_module_it_was_not_started_with(model: str) -> None:
    import sys

    hub = InProcessHub()
    edge = _edge_agent(hub)
    gpu = _gpu_agent(hub)
    before = set(sys.modules)
    hostile = _task(model={**config_to_dict(MODEL), "model": model})
    for agent, device in ((edge, "pi-01"), (gpu, "gpu-a")):
        reply = _reply_to(
            agent, hub, dataclasses.replace(hostile, start=0 if device == "pi-01" else 1), device
        )
        assert reply.has_error(), device  # type: ignore[attr-defined]
        assert "is not a model this device may build" in reply.error.reason  # type: ignore[attr-defined]
        assert f"--model {model}" in reply.error.reason  # type: ignore[attr-defined]
    assert set(sys.modules) - before == set()  # nothing was imported


def test_an_agent_started_with_an_import_path_may_build_it() -> None:
    from split_models.sections import task_sections

    spec = {**config_to_dict(MODEL), "model": "tests.fixtures.gallery:lenet"}
    allowed, _ = task_sections(spec, TRAINING.to_dict(), ("tests.fixtures.gallery:lenet",))
    assert allowed.name == "tests.fixtures.gallery:lenet"


@pytest.mark.parametrize(
    ("training", "field"),
    [
        ({"round_deadline": 1e12}, "task.training.round_deadline"),
        ({"local_epochs": 10**9}, "task.training.local_epochs"),
        ({"batch_size": 1 << 30}, "task.training.batch_size"),
        ({"rounds": 10**12}, "task.training.rounds"),
        ({"federated_eval": float("nan")}, "task.training.federated_eval"),
        ({"optimizer": {"name": "sgd", "lr": 1e9}}, "optimizer.lr"),
    ],
)
def test_every_numeric_field_of_a_task_is_bounded(training: dict[str, object], field: str) -> None:
    from split_models.errors import ConfigError
    from split_models.sections import task_sections

    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        task_sections(config_to_dict(MODEL), {**TRAINING.to_dict(), **training})


@pytest.mark.parametrize(
    ("model", "field"),
    [
        ({"input_shape": [1 << 20, 1 << 20]}, "task.model.input_shape"),
        ({"num_classes": 10**12}, "task.model.num_classes"),
    ],
)
def test_a_task_cannot_ask_for_an_absurd_model(model: dict[str, object], field: str) -> None:
    from split_models.errors import ConfigError
    from split_models.sections import task_sections

    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        task_sections({**config_to_dict(MODEL), **model}, TRAINING.to_dict())


def test_block_indices_and_estimates_of_a_task_are_bounded() -> None:
    with pytest.raises(WireError, match=r"task\.end"):
        Task.parse(_task(end=10**9).to_json())
    with pytest.raises(WireError, match=r"task\.estimated_peak_bytes"):
        Task.parse(_task(estimated_peak_bytes=1 << 62).to_json())


@pytest.mark.parametrize(
    ("changes", "rows"),
    [({}, 16), ({"server_fill": False}, 0), ({"mode": "backprop"}, 0)],
)
def test_a_gpu_server_fills_its_steps_unless_the_run_says_not_to(
    changes: dict[str, object], rows: int
) -> None:
    hub = InProcessHub()
    gpu = _gpu_agent(hub)
    training = dataclasses.replace(TRAINING, **changes)  # type: ignore[arg-type]
    back = gpu.back(_task(start=1, training=training.to_dict()), (MODEL, training))
    assert (back.fill.rows if back.fill is not None else 0) == rows
    back.close()


def test_an_announcement_carries_its_examples_and_refuses_a_bad_count() -> None:
    announced = Announcement("pi-01", "edge", 1 << 30, 1e9, 1e6, examples=640)
    assert Announcement.parse(announced.to_json()) == announced
    older = json.loads(announced.to_json())
    del older["examples"]  # an agent of an earlier version announces none
    assert Announcement.parse(json.dumps(older).encode()).examples is None
    for bad in (-1, 1.5, True, "640", 1 << 41):
        payload = json.dumps({**older, "examples": bad}).encode()
        with pytest.raises(WireError, match=r"announcement\.examples"):
            Announcement.parse(payload)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("flops", 5e-324),
        ("flops", 0.5),
        ("uplink", 1e-300),
        ("flops", 0),
        ("memory", 1e20),  # no store's integer holds it: the coordinator crashed at planning
        ("memory", 2**63),
        ("flops", 1e22),
        ("uplink", 1e300),
    ],
)
def test_an_announced_number_no_plan_or_store_can_use_is_refused(key: str, value: float) -> None:
    # tiny rates made the plan's times overflow, huge memory the store's integer: both crashed
    announced = json.loads(Announcement("pi-01", "edge", 1 << 30, 1e9, 1e6).to_json())
    with pytest.raises(WireError, match=rf"announcement\.{key}: must be"):
        Announcement.parse(json.dumps({**announced, key: value}).encode())
    assert Announcement.parse(json.dumps({**announced, key: 1.0}).encode()) is not None


def test_blocks_over_the_budget_are_refused_in_one_line_not_a_traceback(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # an edge restarted with a smaller --memory is still sent its old blocks: it refuses them
    import edge_client.agent

    monkeypatch.setattr(edge_client.agent, "_SERVERS_WAIT", 0.1)  # no GPU server here
    hub = InProcessHub()
    agent = _edge_agent(hub)
    with caplog.at_level(logging.WARNING):
        reply = _reply_to(agent, hub, _task(estimated_peak_bytes=1 << 40), "pi-01")
    assert reply.has_error()  # type: ignore[attr-defined]
    assert "AssignmentRefused: blocks [0, 2) need" in reply.error.reason  # type: ignore[attr-defined]
    refusals = [r for r in caplog.records if "refused round 1" in r.getMessage()]
    assert len(refusals) == 1 and refusals[0].exc_info is None
    assert not any(r.exc_info for r in caplog.records), "no traceback for a refusal"


def test_blocks_past_the_models_last_are_refused_when_asked_and_when_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import edge_client.agent

    monkeypatch.setattr(edge_client.agent, "_SERVERS_WAIT", 0.1)  # no GPU server here
    hub = InProcessHub()
    agent = _edge_agent(hub)
    blocks = MODEL.build(seed=0).num_blocks
    asked = _reply_to(agent, hub, _task(end=1000), "pi-01", "query")
    answer = asked.content  # type: ignore[attr-defined]
    assert answer.metric_records["metrics"]["accepted"] == 0
    reason = str(answer.config_records["answer"]["reason"])
    assert reason == f"blocks [0, 1000): mlp has {blocks} blocks", reason
    sent = _reply_to(agent, hub, _task(start=1, end=blocks + 1), "pi-01")
    assert f"blocks [1, {blocks + 1}): mlp has {blocks} blocks" in sent.error.reason  # type: ignore[attr-defined]
    # the model's own blocks are still taken
    fits = _reply_to(agent, hub, _task(end=blocks), "pi-01", "query")
    assert fits.content.metric_records["metrics"]["accepted"] == 1  # type: ignore[attr-defined]


@pytest.mark.parametrize("bad", ["nan", "missing", "shape", "dtype"])
def test_weights_that_do_not_fit_the_blocks_are_refused_in_one_line(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    """A train message's weights are checked before anything loads: a rogue or broken one
    was loaded with NaN in it, or failed with a traceback."""
    import edge_client.agent
    from split_models.segment import Segment
    from split_models.weights import segment_state
    from wire.arrays import array_record

    monkeypatch.setattr(edge_client.agent, "_SERVERS_WAIT", 0.1)  # no GPU server here
    hub = InProcessHub()
    agent = _edge_agent(hub)
    segment = Segment.from_model(MODEL.build(seed=0), 0, 2, "linear")
    weights = {k: v.copy() for k, v in segment_state(segment).items()}
    name = next(k for k, v in weights.items() if v.ndim == 2)
    if bad == "nan":
        weights[name][0, 0] = np.nan
    elif bad == "missing":
        del weights[name]
    elif bad == "shape":
        weights[name] = weights[name][:1]
    else:
        weights[name] = weights[name].astype(np.complex64)
    config = ConfigRecord({"task": _task().to_json(), "server-round": 1})
    grid = TransportGrid(InProcessTransport(hub, "coordinator"))
    content = RecordDict({"config": config, "arrays": array_record(weights)})
    message = grid.create_message(content, "train", node_id_for("pi-01"), "edgesplit")
    with caplog.at_level(logging.WARNING):
        reply = agent.client_app()(message, Context(1, node_id_for("pi-01"), {}, RecordDict(), {}))
    assert reply.has_error() and "ModelError" in reply.error.reason, reply.error.reason
    assert name in reply.error.reason
    assert not any(r.exc_info for r in caplog.records), "no traceback for a bad message"


def test_a_gpu_server_refuses_weights_with_nan_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from split_models.segment import Segment
    from split_models.weights import segment_state
    from wire.arrays import array_record

    hub = InProcessHub()
    gpu = _gpu_agent(hub)
    end = MODEL.build(seed=0).num_blocks
    weights = segment_state(Segment.from_model(MODEL.build(seed=0), 2, end, "linear"))
    name = next(iter(weights))
    weights = {**weights, name: np.full_like(weights[name], np.nan)}
    task = _task(start=2, end=end, forward=None)
    config = ConfigRecord({"task": task.to_json(), "server-round": 1})
    grid = TransportGrid(InProcessTransport(hub, "coordinator"))
    content = RecordDict({"config": config, "arrays": array_record(weights)})
    message = grid.create_message(content, "train", node_id_for("gpu-a"), "edgesplit")
    with caplog.at_level(logging.WARNING):
        reply = gpu.client_app()(message, Context(1, node_id_for("gpu-a"), {}, RecordDict(), {}))
    assert reply.has_error(), "NaN weights were taken"
    assert reply.error.reason == f"ModelError: {name}: holds NaN or infinity", reply.error.reason
    assert not any(r.exc_info for r in caplog.records)


def test_an_edge_with_one_example_refuses_a_model_with_batch_norm_when_asked() -> None:
    """Its one-example batches failed every round with BatchNorm's ValueError, logged as a
    ClientApp traceback; the coordinator now plans without it, told why."""
    hub = InProcessHub()
    agent = _edge_agent(hub)
    agent.data = agent.data.subset(np.arange(1))
    norm = config_to_dict(ModelConfig("resnet8", (1, 8, 8), 10))
    asked = _reply_to(agent, hub, _task(model=norm), "pi-01", "query")
    answer = asked.content  # type: ignore[attr-defined]
    assert answer.metric_records["metrics"]["accepted"] == 0
    reason = str(answer.config_records["answer"]["reason"])
    assert "BatchNorm layers (in blocks [" in reason and "cannot train on 1 example" in reason
    plain = _reply_to(agent, hub, _task(), "pi-01", "query")  # mlp: one example trains
    assert plain.content.metric_records["metrics"]["accepted"] == 1  # type: ignore[attr-defined]
