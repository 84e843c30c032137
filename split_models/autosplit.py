"""Automatic splitting of an ordinary ``nn.Module`` into the ordered blocks the planner cuts.

The model is traced with ``torch.fx`` (symbolic tracing, not ``torch.export``: fx keeps the
user's modules and their parameters as they are, so a block trains, aggregates, checkpoints and
exports the model's own ``nn.Conv2d`` or ``nn.LSTM`` objects under their own names, and
BatchNorm's running statistics stay in-place buffer updates; an exported program lifts
parameters into inputs, functionalises buffer mutation and lowers to ATen, all of which would
have to be undone). Shapes come from one pass of an example batch (``ShapeProp``).

A cut is legal between two nodes of the graph when one tensor with the batch dimension that
depends on the weights crosses it (the activation the gradient flows through), possibly with up
to three batched tensors that depend on no weight (an attention mask or position ids computed
from the input: they carry no gradient), and no parameter is used on both sides (tied weights
stay in one block). A residual is never cut: its two branches both depend on weights. Where
side tensors cross, a block takes and returns the tuple ``(activation, *side)``. The nodes
between consecutive legal cuts form a block; a block without weights (a ReLU, a pooling, a
flatten, a normalization layer) joins the block before it. ``split_point(x)`` in a forward, or
module names in ``split_points``, restrict the cuts to the ones the user marked, as the
pipelining package's ``SplitPoint`` does. In-place operations are made out-of-place so that a
block may start with one (``ReLU(inplace=True)`` on a block's input would modify the tensor
another device sent).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import logging
import operator
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata

from split_models.errors import ModelError
from split_models.trace_modes import following_mode, kept_buffers, kept_modes, traced_root

__all__ = ["auto_blocks", "disable_inplace", "split_point"]

log = logging.getLogger(__name__)

_OPS = ("call_function", "call_method", "call_module")
_TRACE_LOCK = threading.Lock()
# architecture key -> its block graphs, and the tensor constants fx kept on the traced model
_TRACED: dict[Hashable, tuple[list[fx.Graph], dict[str, torch.Tensor]]] = {}
_TRACED_MAX = 32
MAX_SIDE_TENSORS = 3  # weight-free tensors (masks, position ids) a cut may carry
_NORMS = (
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.RMSNorm,
)
_INPLACE_OPERATORS: dict[Callable[..., Any], Callable[..., Any]] = {
    operator.iadd: operator.add,
    operator.isub: operator.sub,
    operator.imul: operator.mul,
    operator.itruediv: operator.truediv,
}


def split_point(x: torch.Tensor) -> torch.Tensor:
    """Mark a cut in a model's ``forward``: ``x = split_point(x)``. When a model marks any,
    the planner cuts only there. Outside tracing it returns ``x`` unchanged."""
    if isinstance(x, fx.Proxy):
        return x.tracer.create_proxy("call_function", split_point, (x,), {})
    return x


def disable_inplace(module: nn.Module) -> nn.Module:
    """Turn off ``inplace=True`` on every submodule (ReLU, Dropout, Hardswish...): a block
    whose first layer works in place would write into its input, the tensor another segment
    produced (and, where it needs a gradient, autograd refuses)."""
    for child in module.modules():
        if isinstance(getattr(child, "inplace", None), bool):
            child.inplace = False  # type: ignore[assignment]
    return module


@dataclass(frozen=True)
class _Cut:
    position: int  # the cut sits before ops[position]
    value: fx.Node  # the tensor that crosses it and carries the gradient
    side: tuple[fx.Node, ...] = ()  # weight-free tensors that cross with it, in graph order

    @property
    def values(self) -> tuple[fx.Node, ...]:
        return (self.value, *self.side)


def auto_blocks(
    module: nn.Module,
    example: torch.Tensor,
    split_points: Sequence[str] = (),
    key: Hashable | None = None,
) -> list[nn.Module]:
    """``module`` as an ordered list of blocks sharing its parameters, whose composition is
    the module's forward. ``example`` is a batch of valid inputs (its values are not used for
    anything but shapes); ``split_points`` names modules before which the model may be cut.

    ``key`` names the architecture (the same key, the same graph): a model is traced once per
    process and later instances reuse its block graphs. Tracing patches ``nn.Module.__call__``
    for every thread while it runs, so it must not overlap another thread's forward passes;
    traces are serialised, and the roles build a model before they start training it."""
    disable_inplace(module)
    with _TRACE_LOCK:
        traced = _TRACED.get(key) if key is not None else None
        if traced is None:
            known = set(vars(module))
            graphs = _block_graphs(module, example, split_points)
            added = {n: v for n, v in vars(module).items() if n not in known}
            traced = graphs, {n: v for n, v in added.items() if isinstance(v, torch.Tensor)}
            if key is not None:
                if len(_TRACED) >= _TRACED_MAX:
                    _TRACED.pop(next(iter(_TRACED)))
                _TRACED[key] = traced
    graphs, constants = traced
    for name, value in constants.items():  # what fx kept of forward's tensors (torch.tensor(2.0))
        if name not in vars(module):  # on the traced instance only: a later one gets a copy
            setattr(module, name, value.clone())
    return [
        fx.GraphModule(module, copy.deepcopy(graph), class_name=f"Block{index}")
        for index, graph in enumerate(graphs)
    ]


def _block_graphs(
    module: nn.Module, example: torch.Tensor, split_points: Sequence[str]
) -> list[fx.Graph]:
    graph_module = _trace(module)
    _make_out_of_place(graph_module.graph)
    _propagate_shapes(graph_module, example)
    ops = [node for node in graph_module.graph.nodes if node.op in _OPS]
    if not ops:
        raise ModelError(f"model: {type(module).__name__}.forward does no computation to split")
    cuts = _legal_cuts(module, graph_module, ops, int(example.shape[0]))
    cuts = _chosen_cuts(cuts, ops, split_points, type(module).__name__)
    cuts = _merge_parameter_free(module, ops, cuts)
    return _build_blocks(module, graph_module, ops, cuts)


def _trace(module: nn.Module) -> fx.GraphModule:
    name = type(module).__name__
    parameters = list(inspect.signature(module.forward).parameters.values())
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not positional:
        raise ModelError(f"model: {name}.forward takes no input tensor")
    concrete: dict[str, Any] = {}
    for extra in parameters[1:]:
        if extra.kind in (extra.VAR_POSITIONAL, extra.VAR_KEYWORD):
            continue
        if extra.default is inspect.Parameter.empty:
            raise ModelError(
                f"model: {name}.forward({', '.join(p.name for p in parameters)}) needs more "
                f"than one input; edgesplit feeds one tensor. Give {extra.name!r} a default, "
                "or wrap the model in a module whose forward takes the input alone"
            )
        concrete[extra.name] = extra.default
    try:  # in both modes: what forward reads of self.training is fixed in a trace
        *graphs, leaves = traced_root(module, concrete)
    except Exception as error:  # fx raises TraceError, TypeError, RuntimeError, NotImplementedError
        raise ModelError(
            f"model: cannot trace {name}.forward with torch.fx to split it: "
            f"{type(error).__name__}: {error}. Python control flow on a tensor (an `if` or a "
            "loop on its values or shape) does not trace in the model's own forward; in a "
            "submodule's it is kept whole (a block never cut inside): move it into one, or "
            "return an nn.Sequential or a list of blocks"
        ) from error
    if leaves:
        log.info(
            "%s: kept whole, as their forward does not trace or branches on self.training: %s",
            name,
            ", ".join(leaves),
        )
    graph = following_mode(graphs[0], graphs[1], name)
    _drop_concrete_arguments(graph, name)
    traced = fx.GraphModule(module, graph, class_name=name)
    if _logits_only(graph):
        graph.eliminate_dead_code()  # needs the graph's module, to know impure calls
        traced.recompile()
    return traced


def _logits_only(graph: fx.Graph) -> bool:
    """A forward returning an output object with ``logits`` (a Hugging Face model's
    ``ModelOutput``, a dict) returns the logits alone, and what only fed the rest of the
    object (hidden states, a cache) is to be dropped from the graph (then True)."""
    (output,) = [node for node in graph.nodes if node.op == "output"]
    result = output.args[0]
    if isinstance(result, Mapping) and isinstance(result.get("logits"), fx.Node):
        output.args = (result["logits"],)
        return True
    return False


def _drop_concrete_arguments(graph: fx.Graph, name: str) -> None:
    """Remove the placeholders of arguments traced at their defaults and fx's checks that
    they keep them (``_assert_is_none``, ``eq`` + ``_assert``), so the graph takes the input
    tensor alone."""
    extra = [n for n in graph.nodes if n.op == "placeholder"][1:]
    checks = set(extra)
    for node in graph.nodes:
        inputs = node.all_input_nodes
        if node.op == "call_function" and inputs and all(arg in checks for arg in inputs):
            checks.add(node)
    for node in reversed(list(graph.nodes)):
        if node in checks and not node.users:
            graph.erase_node(node)
    for node in extra:
        if node.graph is graph and node.users:
            raise ModelError(
                f"model: {name}.forward uses its argument {node.target!r} as a value beside "
                "the input; edgesplit feeds one tensor: bind it in a wrapper module"
            )


def _make_out_of_place(graph: fx.Graph) -> None:
    """Rewrite ``x.relu_()``, ``x += y`` and ``F.relu(x, inplace=True)`` out of place where
    nothing reads the mutated tensor afterwards (else the mutation is kept), unless it
    mutates one of the model's buffers or parameters (``self.running.mul_(0.9)``): that
    update is the point, and rewritten it was dead code, the buffer never changed."""
    order = {node: index for index, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.kwargs.get("inplace") is True:
            node.kwargs = {**node.kwargs, "inplace": False}
            continue
        target = _out_of_place(node)
        if target is None or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        mutated = node.args[0]
        if any(order[user] > order[node] for user in mutated.users if user is not node):
            continue
        if _state_of_model(mutated):
            continue
        node.target = target


def _state_of_model(node: fx.Node) -> bool:
    """Whether ``node`` is one of the model's own tensors (a buffer or parameter), or the
    result of in-place operations or views on one (``self.a.mul_(0.9).add_(x)``)."""
    while node.op != "get_attr":
        inplace = _out_of_place(node) is not None or node.kwargs.get("inplace") is True
        view = node.op == "call_function" and node.target is operator.getitem
        view |= node.op == "call_method" and node.target in ("view", "view_as", "detach")
        if not (inplace or view) or not node.args or not isinstance(node.args[0], fx.Node):
            return False
        node = node.args[0]
    return True


def _out_of_place(node: fx.Node) -> Any:
    if node.op == "call_function" and node.target in _INPLACE_OPERATORS:
        return _INPLACE_OPERATORS[node.target]
    if node.op == "call_method" and isinstance(node.target, str):
        name = node.target
        if name.endswith("_") and not name.startswith("_") and hasattr(torch.Tensor, name[:-1]):
            return name[:-1]
    return None


def _propagate_shapes(graph_module: fx.GraphModule, example: torch.Tensor) -> None:
    quiet = contextlib.redirect_stderr(io.StringIO())
    try:  # ShapeProp prints the traceback of a failing node: the one line below says it
        with kept_modes(graph_module), kept_buffers(graph_module), torch.no_grad(), quiet:
            ShapeProp(graph_module.eval()).propagate(example)
    except Exception as error:
        cause = error.__cause__ if isinstance(error.__cause__, Exception) else error
        raise ModelError(
            f"model: running {graph_module.__class__.__name__} on an example batch of shape "
            f"{list(example.shape)} ({example.dtype}) failed: {type(cause).__name__}: {cause}; "
            "check input_shape and input_dtype (forward takes one tensor: a model of a tuple "
            "or dict of inputs needs a wrapper module that builds it from one)"
        ) from error


def _state_ids(module: nn.Module, node: fx.Node) -> set[int]:
    """Identities of the parameters and buffers ``node`` uses directly."""
    if node.op == "call_module":
        used = module.get_submodule(str(node.target))
        return {id(t) for t in (*used.parameters(), *used.buffers())}
    ids = set()
    for arg in node.all_input_nodes:  # tensors only: a block's mode flag is no shared state
        if arg.op == "get_attr" and isinstance(
            used := _attribute(module, str(arg.target)), torch.Tensor
        ):
            ids.add(id(used))
    return ids


def _attribute(module: nn.Module, target: str) -> Any:
    owner, _, name = target.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, name)


def _legal_cuts(
    module: nn.Module, graph_module: fx.GraphModule, ops: list[fx.Node], batch: int
) -> list[_Cut]:
    """Cuts across which one weight-dependent batched tensor flows (with at most a few
    weight-free ones) and no parameter is shared."""
    position = {node: index for index, node in enumerate(ops)}
    end = len(ops)
    last_use: dict[fx.Node, int] = {}
    for node in graph_module.graph.nodes:
        for arg in node.all_input_nodes:
            if arg.op != "get_attr":
                user_at = end if node.op == "output" else position[node]
                last_use[arg] = max(last_use.get(arg, -1), user_at)
    spans: dict[int, list[int]] = {}
    for index, node in enumerate(ops):
        for state in _state_ids(module, node):
            span = spans.setdefault(state, [index, index])
            span[1] = index
    blocked = [0] * (end + 1)
    for first, last in spans.values():
        for cut in range(first + 1, last + 1):
            blocked[cut] = 1
    weighted = _weight_dependent(module, graph_module)
    order = {node: index for index, node in enumerate(graph_module.graph.nodes)}
    live = {n for n in graph_module.graph.nodes if n.op == "placeholder" and n in last_use}
    cuts = []
    for index, node in enumerate(ops):
        live = {value for value in live if last_use[value] >= index}
        if index > 0 and not blocked[index]:
            legal = _cut_at(index, live, weighted, batch, order)
            if legal is not None:
                cuts.append(legal)
        if last_use.get(node, -1) > index:
            live.add(node)
    first, last = max(spans.values(), key=lambda span: span[1] - span[0], default=(0, 0))
    if not cuts and last > first:  # the partitioner refuses one block: say why there is one
        log.warning(
            "%s: no cut between %s and %s, which share a weight (tied embeddings; a Hugging "
            "Face model's tie_word_embeddings=False unties them)",
            type(module).__name__,
            *(ops[i].target if ops[i].op == "call_module" else ops[i].name for i in (first, last)),
        )
    return cuts


def _cut_at(
    index: int, live: set[fx.Node], weighted: set[fx.Node], batch: int, order: dict[fx.Node, int]
) -> _Cut | None:
    """The cut before ``ops[index]`` when ``live`` can cross it: one weight-dependent batched
    tensor and at most ``MAX_SIDE_TENSORS`` batched weight-free ones."""
    carried = [value for value in live if value in weighted]
    side = sorted((value for value in live if value not in weighted), key=order.__getitem__)
    if len(carried) != 1 or len(side) > MAX_SIDE_TENSORS:
        return None
    if not all(_is_batched(value, batch) for value in (*carried, *side)):
        return None
    return _Cut(index, carried[0], tuple(side))


def _weight_dependent(module: nn.Module, graph_module: fx.GraphModule) -> set[fx.Node]:
    """The nodes whose value depends on a parameter (a gradient can flow through them)."""
    parameters = {id(p) for p in module.parameters()}
    dependent: set[fx.Node] = set()
    for node in graph_module.graph.nodes:
        if node.op == "get_attr":
            owns = id(_attribute(module, str(node.target))) in parameters
        elif node.op == "call_module":
            used = module.get_submodule(str(node.target)).parameters()
            owns = any(id(p) in parameters for p in used)
        else:
            owns = False
        if owns or any(arg in dependent for arg in node.all_input_nodes):
            dependent.add(node)
    return dependent


def _is_batched(node: fx.Node, batch: int) -> bool:
    meta = node.meta.get("tensor_meta")
    return isinstance(meta, TensorMetadata) and len(meta.shape) >= 1 and meta.shape[0] == batch


def _chosen_cuts(
    cuts: list[_Cut], ops: list[fx.Node], split_points: Sequence[str], model: str
) -> list[_Cut]:
    """The legal cuts restricted to the marked ones (``split_point`` calls, ``split_points``
    module names), when there are any; a mark that is not a legal cut is an error."""
    marked: dict[int, str] = {}
    for index, node in enumerate(ops):
        if node.op == "call_function" and node.target is split_point:
            marked[index + 1] = "split_point() call"
    for name in split_points:
        found = [
            i
            for i, n in enumerate(ops)
            if n.op == "call_module" and (n.target == name or str(n.target).startswith(name + "."))
        ]
        if not found:
            raise ModelError(f"split_points: {model} has no module named {name!r} in its forward")
        marked[found[0]] = f"split point {name!r}"
    if not marked:
        return cuts
    legal = {cut.position for cut in cuts}
    chosen = []
    for index, what in sorted(marked.items()):
        if index >= len(ops):
            continue  # a mark at the very end cuts nothing
        if index not in legal:
            raise ModelError(
                f"{what} in {model} before {ops[index].name!r} is not a legal cut: more than "
                "one tensor that depends on weights crosses it (a residual), or it separates "
                "layers that share weights; move it to where a single activation flows"
            )
        chosen.append(next(cut for cut in cuts if cut.position == index))
    return chosen


def _has_weights(module: nn.Module, node: fx.Node) -> bool:
    """Whether ``node`` uses parameters other than a normalization layer's (a BatchNorm
    belongs with the convolution before it)."""
    if node.op == "call_module" and isinstance(module.get_submodule(str(node.target)), _NORMS):
        return False
    return bool(_state_ids(module, node))


def _merge_parameter_free(module: nn.Module, ops: list[fx.Node], cuts: list[_Cut]) -> list[_Cut]:
    """Drop cuts so that every block holds weights (a run of nodes without them, such as a
    ReLU, a pooling or a normalization layer, joins the block before it; at the start, the
    block after it)."""
    has_state = [_has_weights(module, node) for node in ops]
    bounds = [0, *(cut.position for cut in cuts), len(ops)]
    kept = []
    for index, cut in enumerate(cuts):
        after = any(has_state[bounds[index + 1] : bounds[index + 2]])
        before = any(has_state[bounds[0] : cut.position])
        if after and before:
            kept.append(cut)
            bounds[0] = cut.position
        # else: the cut is dropped; the run before it continues into the next block
    return kept


def _build_blocks(
    module: nn.Module, graph_module: fx.GraphModule, ops: list[fx.Node], cuts: list[_Cut]
) -> list[fx.Graph]:
    (output,) = [node for node in graph_module.graph.nodes if node.op == "output"]
    result = output.args[0]
    if not isinstance(result, fx.Node) or not isinstance(
        result.meta.get("tensor_meta"), TensorMetadata
    ):
        raise ModelError(
            f"model: {type(module).__name__}.forward must return one tensor (the logits); it "
            "returns a tuple, or a dict without 'logits': wrap it in a module that returns the "
            "logits alone"
        )
    placeholders = [node for node in graph_module.graph.nodes if node.op == "placeholder"]
    starts = [0, *(cut.position for cut in cuts)]
    stops = [*(cut.position for cut in cuts), len(ops)]
    inputs = [(placeholders[0],), *(cut.values for cut in cuts)]
    outputs = [*(cut.values for cut in cuts), (result,)]
    return [
        _block(ops[start:stop], entry, exit_)
        for start, stop, entry, exit_ in zip(starts, stops, inputs, outputs, strict=True)
    ]


def _block(
    nodes: list[fx.Node], entry: tuple[fx.Node, ...], exit_: tuple[fx.Node, ...]
) -> fx.Graph:
    """A block's graph: it takes the tensor (or the tuple of tensors) crossing the cut before
    it and returns what crosses the cut after it."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    env: dict[fx.Node, fx.Node] = {entry[0]: x}
    if len(entry) > 1:
        env = {
            value: graph.call_function(operator.getitem, (x, i)) for i, value in enumerate(entry)
        }

    def mapped(node: fx.Node) -> fx.Node:
        if node not in env:
            if node.op != "get_attr":
                raise ModelError(f"model: node {node.name!r} is used across a cut (internal)")
            env[node] = graph.get_attr(str(node.target))
        return env[node]

    for node in nodes:
        if node.op == "call_function" and node.target is split_point:
            env[node] = mapped(node.args[0])  # type: ignore[arg-type]
            continue
        env[node] = graph.node_copy(node, mapped)
    if len(exit_) == 1:
        graph.output(mapped(exit_[0]))
    else:
        graph.output(tuple(mapped(value) for value in exit_))
    graph.lint()
    return graph
