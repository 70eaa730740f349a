"""The layering of docs/ARCHITECTURE ("arrows only point down") and house style 1, checked on the source.

Every module under dufu/ is parsed with ``ast`` (nothing is imported). Imports are counted wherever they
are, top level or inside a function: a function-local import is still a dependency, only a later one.

The order, bottom to top: layers < models < delta < compress < parallel < data < config < engine < plan < cli (compat
sits beside parallel). Rules:

(a) dufu.models and dufu.layers import nothing from engine, parallel, config, cli or data;
(b) dufu.layers imports no torch.distributed, except the DTensor types (``torch.distributed.tensor``), which a
    layer may look at to read its own sharding (a type check or a ``to_local``) but never creates: process
    groups, collectives and device meshes stay with ``parallelize``;
(c) dufu.parallel imports nothing from dufu.engine;
(d) no import cycle between dufu's subpackages;
(e) no file under dufu/ over 450 lines;
(f) no module under dufu/models reads ``os.environ`` or imports torch.distributed process-group APIs (house
    style 1: model files are single-device code).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

DUFU = Path(__file__).resolve().parents[1] / "dufu"
SUBPACKAGES = ("models", "layers", "delta", "compress", "parallel", "engine", "config", "data", "compat", "plan", "cli")
MAX_LINES = 450
# torch.distributed modules a layer may import: the DTensor types (see (b) above).
LAYERS_ALLOWED_DISTRIBUTED = ("torch.distributed.tensor",)


def _modules() -> list[tuple[Path, str]]:
    out = []
    for path in sorted(DUFU.rglob("*.py")):
        rel = path.relative_to(DUFU.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out.append((path, ".".join(parts)))
    return out


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, imported module) for every import in the file, at any depth; relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.append((node.lineno, base))
            # ``from dufu import engine`` / ``from torch.distributed import tensor`` name modules too
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "*"]
    return found


def _subpackage(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "dufu" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in SUBPACKAGES else None


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(DUFU.parent)}:{line}"


ALL = _modules()


def _violations(rule) -> list[str]:
    out = {}
    for path, module in ALL:
        for line, imported in _imports(path, module):
            message = rule(module, imported)
            if message:  # one line per offending import statement
                out.setdefault((_where(path, line), message), imported)
    return [f"{where}: {message} (import {imported})" for (where, message), imported in sorted(out.items())]


def _report(violations: list[str], what: str) -> None:
    if violations:
        pytest.fail(f"{what}:\n  " + "\n  ".join(violations), pytrace=False)


def test_models_and_layers_import_nothing_above_them():
    above = ("engine", "parallel", "config", "cli", "data")

    def rule(module, imported):
        if _subpackage(module) in ("models", "layers") and _subpackage(imported) in above:
            return f"dufu.{_subpackage(module)} reaches up into dufu.{_subpackage(imported)}"

    _report(_violations(rule), "(a) models and layers import only downward")


def test_layers_leave_torch_distributed_to_parallelize():
    def rule(module, imported):
        if _subpackage(module) != "layers" or not imported.startswith("torch.distributed"):
            return None
        if any(imported == ok or imported.startswith(ok + ".") for ok in LAYERS_ALLOWED_DISTRIBUTED):
            return None
        return "a layer imports torch.distributed beyond the DTensor types"

    _report(_violations(rule), "(b) dufu.layers and torch.distributed")


def test_parallel_does_not_import_the_engine():
    def rule(module, imported):
        if _subpackage(module) == "parallel" and _subpackage(imported) == "engine":
            return "dufu.parallel reaches up into dufu.engine"

    _report(_violations(rule), "(c) dufu.parallel imports dufu.engine")


def test_no_import_cycle_between_subpackages():
    edges: dict[tuple[str, str], list[str]] = {}
    for path, module in ALL:
        src = _subpackage(module)
        for line, imported in _imports(path, module):
            dst = _subpackage(imported)
            if src and dst and src != dst:
                edges.setdefault((src, dst), []).append(f"{_where(path, line)} (import {imported})")
    graph: dict[str, set[str]] = {}
    for src, dst in edges:
        graph.setdefault(src, set()).add(dst)

    cycles = []

    def visit(node, stack):
        for nxt in sorted(graph.get(node, ())):
            if nxt in stack:
                cycle = stack[stack.index(nxt):] + [nxt]
                if cycle[0] == min(cycle[:-1]):  # each cycle once, from its smallest member
                    cycles.append(cycle)
            elif len(stack) < len(SUBPACKAGES):
                visit(nxt, stack + [nxt])

    for start in sorted(graph):
        visit(start, [start])
    lines = []
    for cycle in cycles:
        lines.append(" -> ".join(cycle))
        for src, dst in zip(cycle, cycle[1:]):
            lines += [f"    {src} -> {dst}: {w}" for w in edges[(src, dst)][:3]]
    _report(lines, "(d) import cycles between dufu's subpackages")


def test_no_file_over_450_lines():
    long = [f"{path.relative_to(DUFU.parent)}: {n} lines (at most {MAX_LINES})"
            for path, _ in ALL if (n := len(path.read_text().splitlines())) > MAX_LINES]
    _report(long, "(e) files over 450 lines")


def test_model_files_are_single_device_code():
    process_groups = ("torch.distributed", "torch.distributed.distributed_c10d", "torch.distributed.device_mesh")
    out = []
    for path, module in ALL:
        if _subpackage(module) != "models":
            continue
        for line, imported in _imports(path, module):
            if imported in process_groups or imported.startswith("torch.distributed.distributed_c10d"):
                out.append(f"{_where(path, line)}: a model imports process groups (import {imported})")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "environ":
                out.append(f"{_where(path, node.lineno)}: a model reads os.environ")
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "getenv":
                out.append(f"{_where(path, node.lineno)}: a model reads the environment (getenv)")
    _report(out, "(f) model files are single-device code")
