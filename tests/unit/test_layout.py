"""The repository's shape: who may import whom, and how large a unit may grow.

Read from the source with ``ast`` (imports inside functions count too), so a lazy import cannot
slip a role into another role.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
ROLES = {"coordinator", "edge_client", "gpu_server"}
CORE = {"split_models", "wire", "storage"}
CLI = "edgesplit"
SIMULATION = "simulation"
PACKAGES = ROLES | CORE | {CLI, SIMULATION}
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 50
MAX_COORDINATOR_CLASS_LINES = 250


def _sources(*tops: str) -> Iterator[Path]:
    for top in tops:
        for path in sorted((ROOT / top).rglob("*.py")):
            if "migrations" not in path.relative_to(ROOT).parts:
                yield path


def _imported_packages(path: Path) -> set[str]:
    """The first-party top-level packages ``path`` imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {name.split(".")[0] for name in names} & PACKAGES
    return found


def _forbidden(package: str) -> set[str]:
    if package in ROLES:
        return (ROLES - {package}) | {CLI, SIMULATION}
    if package in CORE:
        return ROLES | {CLI, SIMULATION}
    if package == SIMULATION:
        return {CLI}
    return set()


def test_imports_follow_the_layering() -> None:
    violations = []
    for package in sorted(PACKAGES):
        for path in _sources(package):
            for target in sorted(_imported_packages(path) & _forbidden(package)):
                violations.append(f"{path.relative_to(ROOT)} imports {target}")
    assert violations == []


def test_layering_check_sees_a_lazy_cross_role_import(tmp_path: Path) -> None:
    source = tmp_path / "agent.py"
    source.write_text("def f():\n    from gpu_server.agent import GpuAgent\n    return GpuAgent\n")
    assert _imported_packages(source) & _forbidden("edge_client") == {"gpu_server"}


def _long_units(path: Path) -> Iterator[str]:
    text = path.read_text()
    name = path.relative_to(ROOT)
    if (lines := text.count("\n")) > MAX_FILE_LINES:
        yield f"{name}: {lines} lines (at most {MAX_FILE_LINES})"
    for node in ast.walk(ast.parse(text, str(path))):
        length = (
            (node.end_lineno or node.lineno) - node.lineno + 1 if hasattr(node, "lineno") else 0
        )
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and length > MAX_FUNCTION_LINES:
            yield f"{name}:{node.lineno} {node.name}: {length} lines (at most {MAX_FUNCTION_LINES})"
        in_coordinator = name.parts[0] == "coordinator"
        if (
            isinstance(node, ast.ClassDef)
            and in_coordinator
            and length > MAX_COORDINATOR_CLASS_LINES
        ):
            yield f"{name}:{node.lineno} class {node.name}: {length} lines"


def test_no_unit_outgrows_its_limit() -> None:
    tops = [*sorted(PACKAGES), "tests", "benchmarks"]
    assert [unit for path in _sources(*tops) for unit in _long_units(path)] == []
