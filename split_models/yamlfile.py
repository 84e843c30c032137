"""YAML as edgesplit reads its config files: safe, and a key given twice in one mapping is an
error (PyYAML keeps the last silently: ``rounds: 1`` then ``rounds: 3`` ran 3 rounds)."""

from __future__ import annotations

from typing import Any

import yaml

__all__ = ["load_yaml"]


class _Strict(yaml.SafeLoader):
    """PyYAML's safe loader, refusing duplicate keys."""


def _mapping(loader: _Strict, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            repeated = key in seen
        except TypeError:  # an unhashable key: PyYAML's own constructor refuses it
            continue
        if repeated:
            line = key_node.start_mark.line + 1
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} given twice (line {line})"
            )
        seen.add(key)
    return loader.construct_mapping(node, deep)


_Strict.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def load_yaml(text: str) -> Any:
    """``text`` parsed as YAML (:class:`yaml.YAMLError` when it is not, or repeats a key)."""
    return yaml.load(text, Loader=_Strict)
