"""The partitioner against an independent brute force on random small instances."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.partitioner import (
    LABEL_BYTES,
    TRAIN_FLOPS_FACTOR,
    PartitionConfig,
    Problem,
    place_back,
    plan_split,
    step_seconds,
)
from split_models.devices import DeviceSpec
from split_models.errors import ConfigError, InfeasiblePlanError, ModelError
from split_models.memory import estimate_segment_memory
from split_models.plan import Plan
from split_models.profiler import BlockProfile, ModelProfile, profile_model
from split_models.segment import Segment
from split_models.weights import segment_state
from split_models.zoo import build_model

pytestmark = pytest.mark.unit

KIB = 1024


def _block(
    params: int, out: int, saved: int, flops: int, working: int, buffers: int = 0
) -> BlockProfile:
    return BlockProfile(
        param_bytes=params * KIB,
        buffer_bytes=buffers,
        largest_param_bytes=params * KIB,
        input_shape=(1,),
        output_shape=(out,),
        input_bytes=4 * out,
        output_bytes=4 * out,
        saved_bytes=saved,
        saved_fixed_bytes=0,
        saves_input=True,
        saves_output=False,
        largest_activation_bytes=4 * out,
        flops=flops,
        backward_bytes=working,
        first_backward_bytes=working // 2,
    )


@st.composite
def profiles(draw: st.DrawFn) -> ModelProfile:
    count = draw(st.integers(2, 6))
    blocks = tuple(
        _block(
            draw(st.integers(1, 400)),
            draw(st.integers(1, 300)),
            draw(st.integers(0, 2000)),
            draw(st.integers(1_000, 5_000_000)),
            draw(st.integers(0, 2000)),
            draw(st.sampled_from([0, 0, 4096])),  # BatchNorm's running statistics
        )
        for _ in range(count)
    )
    heads = tuple(_block(draw(st.integers(1, 50)), 10, 40, 2_000, 80) for _ in range(count + 1))
    return ModelProfile("synthetic", (1,), 10, blocks, {"linear": heads})


@st.composite
def fleets(draw: st.DrawFn) -> list[DeviceSpec]:
    edges = [
        DeviceSpec(
            f"edge-{i}",
            "edge",
            draw(st.integers(100, 4000)) * KIB,
            draw(st.sampled_from([1e8, 1e9, 1e10])),
            draw(st.sampled_from([1e5, 1e6, 1e7])),
            draw(st.sampled_from([0, 1, 20])),  # batches a round (0: weights not counted)
        )
        for i in range(draw(st.integers(1, 3)))
    ]
    servers = [
        DeviceSpec(
            f"gpu-{i}",
            "gpu",
            draw(st.integers(200, 6000)) * KIB,
            draw(st.sampled_from([1e8, 1e9, 1e10, 1e12])),
        )
        for i in range(draw(st.integers(1, 3)))
    ]
    return edges + servers


def _memory(profile: ModelProfile, config: PartitionConfig, a: int, b: int) -> int:
    return estimate_segment_memory(
        profile, a, b, config.batch_size, config.optimizer, config.head, config.anchor
    ).total


def _servers_can_hold(
    profile: ModelProfile, config: PartitionConfig, servers: list[DeviceSpec], start: int
) -> bool:
    """Try every ordered subset of servers and every set of cut points."""
    n = profile.num_blocks
    for count in range(1, len(servers) + 1):
        for order in itertools.permutations(servers, count):
            for cuts in itertools.combinations(range(start + 1, n), count - 1):
                bounds = [start, *cuts, n]
                if all(
                    _memory(profile, config, bounds[i], bounds[i + 1]) <= server.memory
                    for i, server in enumerate(order)
                ):
                    return True
    return False


def _brute_force(
    profile: ModelProfile, devices: list[DeviceSpec], config: PartitionConfig
) -> float | None:
    edges = [d for d in devices if d.kind == "edge"]
    servers = [d for d in devices if d.kind == "gpu"]
    n, batch = profile.num_blocks, config.batch_size
    heads = profile.heads[config.local_loss]
    best = None
    options = range(config.min_edge_blocks, n)
    for splits in itertools.product(options, repeat=len(edges)):
        if config.cuts == "uniform" and len(set(splits)) > 1:
            continue
        needs = [  # the step, plus three fp32 payloads and 512 KiB of send buffers
            _memory(profile, config, 0, s)
            + 3 * batch * (profile.blocks[s - 1].output_bytes + LABEL_BYTES)
            + 512 * 1024
            for s in splits
        ]
        if any(need > e.memory for e, need in zip(edges, needs, strict=True)):
            continue
        if not _servers_can_hold(profile, config, servers, min(splits)):
            continue
        edge_times = []
        for edge, s in zip(edges, splits, strict=False):
            head = heads[s].flops if config.head else 0  # a backprop edge runs no head
            flops = sum(b.flops for b in profile.blocks[:s]) + head
            upload = batch * (profile.blocks[s - 1].output_bytes + LABEL_BYTES) / edge.uplink
            step = max(TRAIN_FLOPS_FACTOR * batch * flops / edge.flops, upload)
            if edge.round_batches:  # the segment's weights down and up, spread over the round
                state = [*profile.blocks[:s], heads[s]]
                weights = sum(b.param_bytes + b.buffer_bytes for b in state)
                step += 2 * weights / edge.uplink / edge.round_batches
            edge_times.append(step)
        back = sum(sum(b.flops for b in profile.blocks[s:]) for s in splits)
        server = TRAIN_FLOPS_FACTOR * batch * back / sum(s.flops for s in servers)
        objective = max(max(edge_times), server)
        best = objective if best is None else min(best, objective)
    return best


@settings(max_examples=300, deadline=None)
@given(
    profile=profiles(),
    devices=fleets(),
    batch=st.sampled_from([1, 8, 32]),
    cuts=st.sampled_from(["per-device", "per-device", "uniform"]),
    anchor=st.booleans(),
    mode=st.sampled_from(["local-loss", "backprop"]),
)
def test_partitioner_matches_brute_force(
    profile: ModelProfile,
    devices: list[DeviceSpec],
    batch: int,
    cuts: str,
    anchor: bool,
    mode: str,
) -> None:
    config = PartitionConfig(batch_size=batch, optimizer="sgd", cuts=cuts, anchor=anchor, mode=mode)
    expected = _brute_force(profile, devices, config)
    if expected is None:
        with pytest.raises(InfeasiblePlanError):
            plan_split(profile, devices, config)
        return
    plan = plan_split(profile, devices, config)
    assert math.isclose(plan.estimated_step_seconds, expected, rel_tol=1e-9)
    problem = Problem.build(profile, config)
    edges = [d for d in devices if d.kind == "edge"]
    servers = [d for d in devices if d.kind == "gpu"]
    splits = [plan.edge(e.name).blocks[1] for e in edges]
    assert math.isclose(step_seconds(problem, edges, servers, splits), expected, rel_tol=1e-9)
    for row in plan.edges:
        assert row.estimated_peak_bytes <= row.budget_bytes
    for row in plan.servers:
        assert row.estimated_peak_bytes <= row.budget_bytes
    spans = sorted(row.blocks for row in plan.servers)
    assert spans[0][0] <= min(splits) and spans[-1][1] == profile.num_blocks
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans)), "server pieces are contiguous"


def _fleet(edge_memory: int, server_memory: int = 10**9) -> list[DeviceSpec]:
    return [
        DeviceSpec("pi-01", "edge", edge_memory, 1e9, 1e6),
        DeviceSpec("gpu-a", "gpu", server_memory, 1e12),
    ]


def _small_profile() -> ModelProfile:
    blocks = tuple(_block(100, 100, 400, 10_000, 400) for _ in range(4))
    heads = tuple(_block(5, 10, 40, 200, 80) for _ in range(5))
    return ModelProfile("tiny", (1,), 10, blocks, {"linear": heads})


def test_edge_too_small_names_device_need_and_fix() -> None:
    with pytest.raises(InfeasiblePlanError) as caught:
        plan_split(_small_profile(), _fleet(1024), PartitionConfig(batch_size=8))
    message = str(caught.value)
    assert "'pi-01'" in message and "1.0 KiB" in message and "blocks [0, 1)" in message
    assert "lower the batch size" in message


def test_a_model_of_one_block_is_a_model_error_naming_the_ways_out() -> None:
    whole = _small_profile()
    one = ModelProfile("one", (1,), 10, whole.blocks[:1], {"linear": whole.heads["linear"][:2]})
    with pytest.raises(ModelError) as caught:  # not a plan short of memory: no memory hint
        plan_split(one, _fleet(1 << 30), PartitionConfig(batch_size=8))
    assert str(caught.value).endswith(
        "use a model of several layers, name split_points inside it, or train it whole "
        "(--method centralized or fedavg)"
    )


def test_a_splitfed_edge_is_sized_for_the_gradient_it_receives_not_for_a_head() -> None:
    profile = _small_profile()
    local, splitfed = PartitionConfig(batch_size=8), PartitionConfig(batch_size=8, mode="backprop")
    assert splitfed.head is None and local.head == "linear"
    need = Problem.build(profile, splitfed).edge_memory
    estimate = {  # of [0, 1): with the linear head, and with the received gradient instead
        head: estimate_segment_memory(profile, 0, 1, 8, "sgd-momentum", head).total
        for head in ("linear", None)
    }
    assert need[1] - Problem.build(profile, local).edge_memory[1] == (
        estimate[None] - estimate["linear"]
    )
    with pytest.raises(InfeasiblePlanError, match=r"blocks \[0, 1\) with no head \(backprop"):
        plan_split(profile, _fleet(need[1] - 1), splitfed)
    with pytest.raises(InfeasiblePlanError, match="1 B more than it has"):  # not "2.7 MiB" twice
        plan_split(profile, _fleet(need[1] - 1), splitfed)
    assert plan_split(profile, _fleet(need[1]), splitfed).edge("pi-01").blocks == (0, 1)


def test_many_edges_too_small_get_one_line_per_memory_size() -> None:
    small = [DeviceSpec(f"pi-{i:04d}", "edge", 1024, 1e9, 1e6) for i in range(500)]
    smaller = [DeviceSpec(f"zero-{i}", "edge", 512, 1e9, 1e6) for i in range(2)]
    fits = [DeviceSpec("big", "edge", 10**9, 1e9, 1e6)]
    devices = [*small, *smaller, *fits, DeviceSpec("gpu-a", "gpu", 10**9, 1e12)]
    with pytest.raises(InfeasiblePlanError) as caught:
        plan_split(_small_profile(), devices, PartitionConfig(batch_size=8))
    lines = str(caught.value).splitlines()
    assert len(lines) == 3, lines  # a heading, then one line per memory size
    assert "500 edges ('pi-0000', 'pi-0001', 'pi-0002' and 497 more) have 1.0 KiB" in lines[1]
    assert "2 edges ('zero-0', 'zero-1') have 512 B" in lines[2]
    assert "big" not in str(caught.value)


def test_servers_too_small_is_reported() -> None:
    with pytest.raises(InfeasiblePlanError, match="GPU servers cannot hold"):
        plan_split(_small_profile(), _fleet(10**9, server_memory=1024), PartitionConfig())


def test_missing_device_kinds_are_reported() -> None:
    profile = _small_profile()
    with pytest.raises(InfeasiblePlanError, match="no GPU server"):
        plan_split(profile, _fleet(10**9)[:1], PartitionConfig())
    with pytest.raises(InfeasiblePlanError, match="no edge device"):
        plan_split(profile, _fleet(10**9)[1:], PartitionConfig())


def test_min_edge_blocks_is_respected_and_validated() -> None:
    plan = plan_split(_small_profile(), _fleet(10**9), PartitionConfig(min_edge_blocks=3))
    assert plan.edges[0].blocks == (0, 3)
    with pytest.raises(ConfigError, match="min_edge_blocks"):
        plan_split(_small_profile(), _fleet(10**9), PartitionConfig(min_edge_blocks=4))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("batch_size", 0),
        ("optimizer", "rmsprop"),
        ("local_loss", "nope"),
        ("compression", "fp8"),
        ("cuts", "per-edge"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        PartitionConfig(**{field: value})  # type: ignore[arg-type]


def test_plan_json_round_trip_and_table() -> None:
    plan = plan_split(_small_profile(), _fleet(10**9), PartitionConfig(batch_size=4))
    again = Plan.from_json(plan.to_json())
    assert again == plan
    text = str(plan)
    assert "pi-01" in text and "gpu-a" in text and "estimated step time" in text


def test_plan_from_malformed_json_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="format"):
        Plan.from_dict({"format": 99})
    with pytest.raises(ConfigError, match="malformed"):
        Plan.from_dict({"format": 1, "edges": [{"name": "x"}], "servers": []})


def test_compression_shrinks_cut_bytes() -> None:
    fp32 = plan_split(_small_profile(), _fleet(10**9), PartitionConfig(min_edge_blocks=2))
    int8 = plan_split(
        _small_profile(), _fleet(10**9), PartitionConfig(min_edge_blocks=2, compression="int8")
    )
    assert fp32.edges[0].blocks == int8.edges[0].blocks
    assert (
        int8.edges[0].cut_bytes_per_sample - LABEL_BYTES
        == (fp32.edges[0].cut_bytes_per_sample - LABEL_BYTES) // 4
    )


def test_server_packing_finds_an_order_that_largest_first_misses() -> None:
    # Block 1 is light, block 2 is heavy. The big server fits only block 2 and the small one
    # only block 1, so the back [1, 3) fits only as small-then-big.
    blocks = (_block(10, 10, 0, 1000, 0), _block(10, 10, 0, 1000, 0), _block(1000, 10, 0, 1000, 0))
    heads = tuple(_block(1, 10, 0, 10, 0) for _ in range(4))
    profile = ModelProfile("skewed", (1,), 10, blocks, {"linear": heads})
    config = PartitionConfig(batch_size=1, optimizer="sgd")
    heavy = _memory(profile, config, 2, 3)
    light = _memory(profile, config, 1, 2)
    assert _memory(profile, config, 1, 3) > heavy > light
    devices = [
        DeviceSpec("edge", "edge", Problem.build(profile, config).edge_memory[1], 1e9, 1e6),
        DeviceSpec("big", "gpu", heavy, 1e12),
        DeviceSpec("small", "gpu", light, 1e12),
    ]
    plan = plan_split(profile, devices, config)
    assert [(s.name, s.blocks) for s in plan.servers] == [("small", (1, 2)), ("big", (2, 3))]


def test_a_back_placed_anew_covers_it_in_pieces_or_names_the_shortfall() -> None:
    blocks = (_block(10, 10, 0, 1000, 0), _block(10, 10, 0, 1000, 0), _block(1000, 10, 0, 1000, 0))
    heads = tuple(_block(1, 10, 0, 10, 0) for _ in range(4))
    profile = ModelProfile("skewed", (1,), 10, blocks, {"linear": heads})
    config = PartitionConfig(batch_size=1, optimizer="sgd")
    heavy, light = _memory(profile, config, 2, 3), _memory(profile, config, 1, 2)
    servers = [DeviceSpec("big", "gpu", heavy, 1e12), DeviceSpec("small", "gpu", light, 1e12)]

    pieces = place_back(profile, servers, config, 1)

    assert [(s.name, s.blocks) for s in pieces] == [("small", (1, 2)), ("big", (2, 3))]
    assert [s.estimated_peak_bytes for s in pieces] == [light, heavy]
    with pytest.raises(InfeasiblePlanError, match=r"cannot hold blocks \[1, 3\)"):
        place_back(profile, servers[1:], config, 1)


def test_the_command_prints_the_reasons_numbered_on_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from edgesplit.exits import EXIT_USAGE, exit_for

    error = InfeasiblePlanError("edge devices cannot take part:\n  - 3 edges (a)\n  - edge 'b'")
    assert exit_for("plan", error) == EXIT_USAGE
    assert capsys.readouterr().err == (
        "edgesplit plan: error: edge devices cannot take part: (1) 3 edges (a) (2) edge 'b'\n"
    )


@settings(max_examples=50, deadline=None)
@given(profile=profiles(), batches=st.sampled_from([0, 1, 20]))
def test_a_compute_bound_edge_is_named_so_whatever_its_weight_traffic(
    profile: ModelProfile, batches: int
) -> None:
    slow = DeviceSpec("edge-0", "edge", 1 << 40, 1.0, 1e12, batches)  # 1 FLOP/s, fast link
    plan = plan_split(profile, [slow, DeviceSpec("gpu", "gpu", 1 << 40, 1e15)], PartitionConfig())
    assert plan.bottleneck == "edge 'edge-0' compute"
    assert plan.edges[0].weight_bytes > 0


@settings(max_examples=100, deadline=None)
@given(profile=profiles(), devices=fleets())
def test_one_uniform_cut_is_never_faster_than_per_device_cuts(
    profile: ModelProfile, devices: list[DeviceSpec]
) -> None:
    try:
        uniform = plan_split(profile, devices, PartitionConfig(cuts="uniform"))
    except InfeasiblePlanError:
        return
    assert len({row.blocks for row in uniform.edges}) == 1
    free = plan_split(profile, devices, PartitionConfig())
    assert free.estimated_step_seconds <= uniform.estimated_step_seconds * (1 + 1e-12)


def test_a_small_device_holds_the_uniform_cut_back_where_per_device_cuts_free_the_others() -> None:
    blocks = tuple(_block(100, out, 400, 10_000, 400) for out in (300, 200, 100, 10))
    heads = tuple(_block(5, 10, 40, 200, 80) for _ in range(5))
    profile = ModelProfile("narrowing", (1,), 10, blocks, {"linear": heads})  # deeper: less sent
    problem = Problem.build(profile, PartitionConfig(batch_size=8))
    small = DeviceSpec("sensor", "edge", problem.edge_memory[1], 1e9, 1e9)  # holds [0, 1) only
    slow_link = DeviceSpec("phone", "edge", 10**9, 1e9, 1e3)  # wants the deepest cut
    fleet = [small, slow_link, DeviceSpec("gpu-a", "gpu", 10**9, 1e12)]
    free = plan_split(profile, fleet, PartitionConfig(batch_size=8))
    one = plan_split(profile, fleet, PartitionConfig(batch_size=8, cuts="uniform"))
    assert [e.blocks[1] for e in free.edges] == [1, 3]
    assert [e.blocks[1] for e in one.edges] == [1, 1]
    assert one.bottleneck == "edge 'phone' upload"
    assert free.estimated_step_seconds < one.estimated_step_seconds


def test_plan_cuts_name_each_edge_or_count_them_in_a_large_fleet() -> None:
    profile = _small_profile()
    fleet = [DeviceSpec(f"pi-{i:02d}", "edge", 10**9, 1e9, 1e6) for i in range(13)]
    fleet.append(DeviceSpec("gpu-a", "gpu", 10**9, 1e12))
    plan = plan_split(profile, fleet, PartitionConfig(cuts="uniform"))
    cut = plan.edges[0].blocks[1]
    assert plan.cuts() == str({cut: "13 edges"})
    assert plan.cuts(listed=13) == str({f"pi-{i:02d}": cut for i in range(13)})


def test_the_weight_traffic_counted_is_the_state_an_edge_receives_batchnorm_included() -> None:
    model = build_model("resnet8", (1, 8, 8), 10, seed=0)
    profile = profile_model(model, ("linear",), 4)
    problem = Problem.build(profile, PartitionConfig(batch_size=4))
    assert problem.edge_weight_bytes is not None
    for cut in range(1, model.num_blocks):
        state = segment_state(Segment.from_model(model, 0, cut, "linear"))
        assert problem.edge_weight_bytes[cut] == sum(a.nbytes for a in state.values()), cut


def test_fedprox_anchor_counts_a_copy_of_the_trainable_weights_and_can_move_the_cut() -> None:
    profile = _small_profile()
    plain, anchored = (
        estimate_segment_memory(profile, 0, 2, 8, "sgd-momentum", "linear", anchor)
        for anchor in (False, True)
    )
    weights = 2 * profile.blocks[0].param_bytes + profile.heads["linear"][2].param_bytes
    assert anchored.optimizer_state - plain.optimizer_state == weights
    assert anchored.total - plain.total == weights

    # an edge with just the memory for blocks [0, 2) without the anchor: with it, it has not
    config = PartitionConfig(batch_size=8, min_edge_blocks=2)
    budget = Problem.build(profile, config).edge_memory[2]
    assert plan_split(profile, _fleet(budget), config).edge("pi-01").blocks == (0, 2)
    with pytest.raises(InfeasiblePlanError, match="'pi-01'"):
        plan_split(profile, _fleet(budget), replace(config, anchor=True))
