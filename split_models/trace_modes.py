"""A traced graph that follows its block's train or eval mode where ``forward`` read it.

``torch.fx`` records the value ``self.training`` had while tracing, so a model passing it to a
function (``F.dropout(x, p, self.training)``, ``dropout_p=p if self.training else 0``) kept
dropout on in evaluation and export. The model is traced in both modes
(:func:`split_models.autosplit.auto_blocks`); where the two graphs differ only in such values,
the graph reads the block's own ``training`` flag when it runs.

A submodule whose own ``forward`` does not trace, or takes another path in each mode, is kept
whole (a leaf of the graph, run as it is), and the trace starts again
(:func:`traced_in_both_modes`).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx, nn

from split_models.errors import ModelError

__all__ = [
    "by_mode",
    "following_mode",
    "kept_buffers",
    "kept_modes",
    "traced_in_both_modes",
    "traced_root",
]


@contextlib.contextmanager
def kept_buffers(module: nn.Module) -> Iterator[None]:
    """Put every buffer of ``module`` back as it is now: a model whose forward updates a buffer
    in place (a running mean of its own) changes it on every call, and an example pass, an
    export and its check must leave it, and see it, as it was."""
    kept = [(buffer, buffer.clone()) for buffer in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in kept:
                buffer.copy_(value)


@contextlib.contextmanager
def kept_modes(module: nn.Module) -> Iterator[None]:
    """Put every submodule of ``module`` back in the mode it had (``module.train(was)`` would
    put a frozen part kept in eval mode in train mode with the rest)."""
    modes = {part: part.training for part in module.modules()}
    try:
        yield
    finally:
        for part, training in modes.items():
            part.training = training


def traced_in_both_modes(
    module: nn.Module, concrete: dict[str, Any]
) -> tuple[fx.Graph, fx.Graph, list[str]]:
    """Traces of ``module`` in train and in eval mode, each submodule left in the mode it had
    (a frozen backbone kept in eval stays so), and the submodules kept whole. fx keeps a
    tensor made in ``forward`` (``torch.tensor(2.0)``) on ``module`` as ``_tensor_constant0``:
    both traces name it alike, and the train trace's constants stay on ``module``, as one trace
    leaves them.

    A submodule whose own ``forward`` cannot be traced (Python control flow on its input's
    shape or dtype, a loop over a tensor: the usual case in third-party models) is kept whole,
    a leaf of the graph that runs its forward as it is, and the trace starts again; the blocks
    can then be cut around it but not inside it. So is one whose forward takes another path in
    each mode (``if self.training: x = x + noise``): run whole, it follows its own mode. Only
    the root's own code must trace, and branch on its mode through values alone
    (:func:`following_mode`)."""
    leaves: set[str] = set()
    for _ in range(sum(1 for _ in module.modules()) + 1):
        tracer = _LeafTracer(leaves)
        try:
            training, evaluating = _both(module, concrete, tracer)
        except Exception:
            if tracer.culprit is None or tracer.culprit in leaves:
                raise
            leaves.add(tracer.culprit)
            continue
        branching = _branching_part(training, evaluating)
        if branching is None or branching in leaves:
            return training, evaluating, sorted(leaves)
        leaves.add(branching)
    raise AssertionError("unreachable: every submodule is a leaf by now")


def traced_root(
    module: nn.Module, concrete: dict[str, Any]
) -> tuple[fx.Graph, fx.Graph, list[str]]:
    """:func:`traced_in_both_modes`, or where the root's own ``forward`` does not trace as a
    root but does as a submodule's call (a decorated ``forward(x, **kwargs)``, as Hugging Face
    models have: fx hands the root's arguments to it otherwise), the trace of a module calling
    it, named as ``module``'s own. A root that does not trace either way raises its own error."""
    try:
        return traced_in_both_modes(module, concrete)
    except Exception as error:
        failed = error
    shell = _Shell(module)
    known = set(vars(shell))
    try:
        training, evaluating, leaves = traced_in_both_modes(shell, {})
    except Exception:
        raise failed from None
    if _Shell.INNER in leaves:  # only whole: the root's own code is what does not trace
        raise failed
    for name in set(vars(shell)) - known:  # the tensors fx kept of forward's, on the root
        setattr(module, name, vars(shell)[name])
    prefix = f"{_Shell.INNER}."
    for node in itertools.chain(training.nodes, evaluating.nodes):
        if node.op in ("call_module", "get_attr") and str(node.target).startswith(prefix):
            node.target = str(node.target).removeprefix(prefix)
    return training, evaluating, [leaf.removeprefix(prefix) for leaf in leaves]


class _Shell(nn.Module):
    INNER = "inner"

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Any) -> Any:
        return self.inner(x)


class _LeafTracer(fx.Tracer):
    """fx's tracer, keeping ``leaves`` (qualified names) whole, and recording the innermost
    submodule whose forward raised (``culprit``; None when the root's own code did)."""

    def __init__(self, leaves: set[str]) -> None:
        super().__init__()
        # a buffer read in forward is the model's tensor, not a constant of the trace: an
        # in-place update of it (``self.running.mul_(0.9)``) is recorded, not run once on it
        # while tracing and lost
        self.proxy_buffer_attributes = True
        self.leaves = leaves
        self.culprit: str | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.leaves or super().is_leaf_module(
            m, module_qualified_name
        )

    def call_module(
        self, m: nn.Module, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.culprit is None:
                self.culprit = self.path_of_module(m)
            raise


def _branching_part(training: fx.Graph, evaluating: fx.Graph) -> str | None:
    """The submodule (qualified name) whose forward took another path in train mode than in
    eval mode, where the two traces first part ways; None where they do not part (values
    chosen by mode aside) or the root's own forward did."""
    for ours, theirs in itertools.zip_longest(training.nodes, evaluating.nodes):
        if ours is not None and theirs is not None and _alike(ours, theirs):
            continue
        parts = [p for p in (_part_of(ours), _part_of(theirs)) if p]
        # of two nested parts the inner one (keep as little whole as will do)
        inner = [p for p in parts if all(q == p or p.startswith(f"{q}.") for q in parts)]
        return (inner or parts)[0] if parts else None
    return None


def _alike(ours: fx.Node, theirs: fx.Node) -> bool:
    """The same step in both traces, but for values chosen by mode (:func:`following_mode`)."""
    if (ours.op, ours.target, len(ours.args)) != (theirs.op, theirs.target, len(theirs.args)):
        return False
    if set(ours.kwargs) != set(theirs.kwargs):
        return False
    values = [_ModeValue(a, b) for a, b in zip(ours.args, theirs.args, strict=True)]
    values += [_ModeValue(v, theirs.kwargs[k]) for k, v in ours.kwargs.items()]
    return all(v.same or v.by_mode for v in values)


def _part_of(node: fx.Node | None) -> str | None:
    """The submodule whose forward made ``node`` (a called module's own call is its caller's
    step); None for the root's."""
    stack = (
        [] if node is None else [path for path, _ in node.meta.get("nn_module_stack", {}).values()]
    )
    if node is not None and node.op == "call_module":
        stack = stack[:-1]
    return stack[-1] if stack else None


def _both(
    module: nn.Module, concrete: dict[str, Any], tracer: fx.Tracer
) -> tuple[fx.Graph, fx.Graph]:
    known = set(vars(module))
    graphs: list[fx.Graph] = []
    kept: dict[str, Any] = {}
    try:
        with kept_modes(module):
            for mode in (True, False):
                graphs.append(tracer.trace(module.train(mode), concrete_args=concrete or None))
                added = {name: vars(module).pop(name) for name in set(vars(module)) - known}
                kept = added if mode else kept
    finally:
        for name in set(vars(module)) - known:
            del vars(module)[name]
        vars(module).update(kept)
    return graphs[0], graphs[1]


def following_mode(training: fx.Graph, evaluating: fx.Graph, name: str) -> fx.Graph:
    """``training`` (a trace in train mode), where ``forward`` passed a value of its mode to
    a function (``F.dropout(x, p, self.training)``, ``dropout_p=p if self.training else 0``),
    reading the block's mode when it runs: a trace holds the value it saw, which left dropout
    on in evaluation and export. A forward that takes another path in each mode
    (``if self.training:``) cannot be one graph."""
    pairs = list(zip(training.nodes, evaluating.nodes, strict=False))
    same = len(training.nodes) == len(evaluating.nodes) and all(_alike(a, b) for a, b in pairs)
    for ours, theirs in pairs if same else ():
        args = [_ModeValue(a, b) for a, b in zip(ours.args, theirs.args, strict=True)]
        kwargs = {k: _ModeValue(v, theirs.kwargs[k]) for k, v in ours.kwargs.items()}
        ours.args = tuple(v.in_graph(training, ours) for v in args)
        ours.kwargs = {k: v.in_graph(training, ours) for k, v in kwargs.items()}
    if not same:
        raise ModelError(
            f"model: {name}.forward computes something else in training than in evaluation "
            "(it branches on self.training in its own code), and a traced graph holds one of "
            "the two: move the branch into a submodule (kept whole, it follows its own mode), "
            "use modules that follow train() and eval() (nn.Dropout, nn.BatchNorm2d), or "
            "return the model as an nn.Sequential or a list of blocks, which run as they are"
        )
    return training


def by_mode(training: bool, when_training: Any, when_evaluating: Any) -> Any:
    """The value of a block's mode (in a traced graph: what ``forward`` chose by it)."""
    return when_training if training else when_evaluating


class _ModeValue:
    """An argument as traced in train mode (``ours``) and eval mode (``theirs``)."""

    def __init__(self, ours: Any, theirs: Any) -> None:
        self.ours, self.theirs = ours, theirs
        self.same = fx.node.map_arg(ours, _named) == fx.node.map_arg(theirs, _named)
        numbers = all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in (ours, theirs)
        )
        self.by_mode = not self.same and ((ours is True and theirs is False) or numbers)

    def in_graph(self, graph: fx.Graph, user: fx.Node) -> Any:
        """The argument ``user`` takes: the traced value, or one read from the mode."""
        if not self.by_mode:
            return self.ours
        with graph.inserting_before(user):
            flag = graph.get_attr("training")
            if self.ours is True and self.theirs is False:
                return flag
            return graph.call_function(by_mode, (flag, self.ours, self.theirs))


def _named(node: fx.Node) -> str:
    return node.name
