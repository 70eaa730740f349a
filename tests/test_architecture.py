"""The layering of docs/architecture.md ("arrows only point down"), its rooms by responsibility (house style 13)
and house styles 1 and 9, checked on the source.

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
(e) no module over 600 lines: a smell to look at (is it one job?), not a number to split under;
(f) no module under dufu/models reads ``os.environ`` or imports torch.distributed process-group APIs (house
    style 1: model files are single-device code);
(g) no import cycle between dufu's modules: no two modules import each other, directly or around a longer loop;
(h) a private module (``_x.py``) is imported only from its own package;
(i) every module says its one job in a docstring, its first statement (a packaged config, in its first line: the
    comment `dufu configs` lists);
(j) nothing in dufu/, tests/ or benchmarks/ assigns to a Trainer's methods (house style 9: features that change a
    step are hooks).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DUFU = ROOT / "dufu"
SUBPACKAGES = ("models", "layers", "delta", "compress", "parallel", "engine", "config", "data", "compat", "plan", "cli")
MAX_LINES = 600
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
    return f"{path.relative_to(ROOT)}:{line}"


ALL = _modules()
MODULES = {module: path for path, module in ALL}


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


def test_no_module_over_600_lines():
    long = [f"{path.relative_to(ROOT)}: {n} lines (at most {MAX_LINES}): does it still do one job?"
            for path, _ in ALL if (n := len(path.read_text().splitlines())) > MAX_LINES]
    _report(long, f"(e) modules over {MAX_LINES} lines")


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


# ---------------------------------------------------------------------------------------- (g) module cycles


def _dufu_module(imported: str) -> str | None:
    """The module of dufu an imported name lives in: the longest prefix of it that is a module file."""
    while imported and imported not in MODULES:
        imported = imported.rpartition(".")[0]
    return imported or None


def _imported_modules(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, dufu module) for every import in the file: ``from a.b import c`` imports the module ``a.b.c`` if
    there is one, else the name ``c`` of ``a.b``. Importing ``a.b.c`` runs the packages ``a`` and ``a.b`` first;
    those implicit imports are not edges (a module importing its package's sibling is no cycle with the package)."""
    by_line: dict[int, list[str]] = {}
    for line, imported in _imports(path, module):
        by_line.setdefault(line, []).append(imported)
    out = []
    for line, names in by_line.items():
        targets = {t for t in map(_dufu_module, names) if t is not None}
        # drop a package when the statement names modules inside it (``from . import loader, serialize``)
        out += [(line, t) for t in sorted(targets) if not any(o.startswith(t + ".") for o in targets)]
    return out


def _module_graph() -> dict[str, dict[str, str]]:
    """module -> {imported module: where the first such import is}, over dufu's modules, at any depth."""
    graph: dict[str, dict[str, str]] = {}
    for path, module in ALL:
        for line, target in _imported_modules(path, module):
            if target != module:
                graph.setdefault(module, {}).setdefault(target, _where(path, line))
    return graph


def _cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan): every module of one reaches every
    other through imports, so each holds at least one cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(MODULES):
        if v not in index:
            connect(v)
    return sorted(found)


def test_no_import_cycle_between_modules():
    graph = _module_graph()
    cycles = _cycles(graph)
    lines = []
    for component in cycles:
        lines.append(" <-> ".join(component) if len(component) == 2 else "cycle among " + ", ".join(component))
        members = set(component)
        lines += [f"    {src} -> {dst}: {graph[src][dst]}"
                  for src in component for dst in sorted(graph.get(src, ())) if dst in members]
    _report(lines, "(g) import cycles between dufu's modules (give the shared part a module of its own, below "
                   "both, or move each function to the module whose job it is)")


# ------------------------------------------------------------------------------------- (h) private modules


def test_private_modules_stay_in_their_package():
    def rule(module, imported):
        target = _dufu_module(imported)
        if target is None:
            return None
        name = target.rpartition(".")[2]
        if not name.startswith("_") or name.startswith("__"):
            return None
        own_package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
        if target.rpartition(".")[0] != own_package:
            return f"{module} imports the private module {target} of another package"

    _report(_violations(rule), "(h) private modules imported from another package (make the module public, or "
                               "move what is shared to where it belongs)")


# ----------------------------------------------------------------------------------------- (i) docstrings


def test_every_module_says_its_job():
    out = []
    for path, module in ALL:
        source = path.read_text()
        tree = ast.parse(source)
        if module == "dufu.configs" or module.startswith("dufu.configs."):
            # a packaged config is data: its first line is the comment `dufu configs` shows
            if tree.body and not source.lstrip().startswith("#"):
                out.append(f"{_where(path, 1)}: a packaged config without a first comment line saying what it is")
            continue
        if not tree.body:  # an empty __init__.py marks a package and does nothing
            continue
        doc = ast.get_docstring(tree)
        if not doc or not doc.strip():
            out.append(f"{_where(path, 1)}: no docstring as its first statement, saying its one job")
    _report(out, "(i) modules without a docstring")


# ------------------------------------------------------------------------------ (j) no patched Trainer


def _trainer_method_names() -> set[str]:
    """Methods of every class named Trainer in dufu/, and the step-level ones even if the class moves."""
    names = {"train", "train_step", "forward_backward", "evaluate", "save_checkpoint", "load_checkpoint"}
    for path, _ in ALL:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name == "Trainer":
                names |= {f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return names


# Receivers that name a Trainer (the class, an instance or a module attribute): Trainer, trainer, self.trainer,
# trainer_mod.Trainer, state["trainer"] ... but not trainer_mod itself.
_TRAINERISH = re.compile(r"(?<![A-Za-z0-9_])[Tt]rainer(?![A-Za-z0-9_])")
# Always a step being replaced, whatever the receiver is called.
_STEP_METHODS = {"train_step", "forward_backward"}
# Calls that read an attribute by name rather than set it.
_READERS = {"getattr", "hasattr", "getattr_static", "isinstance", "issubclass"}


def _patches_of_trainer(path: Path, methods: set[str]) -> list[str]:
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except SyntaxError:
        return []
    aliases: set[str] = set()  # names bound to a Trainer-ish expression (T = trainer_mod.Trainer)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _TRAINERISH.search(ast.unparse(node.value)):
            aliases |= {t.id for t in node.targets if isinstance(t, ast.Name)}

    def trainerish(expr: ast.expr) -> bool:
        return bool(_TRAINERISH.search(ast.unparse(expr))) or (isinstance(expr, ast.Name) and expr.id in aliases)

    out = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        while targets:
            t = targets.pop()
            if isinstance(t, (ast.Tuple, ast.List)):  # a, trainer.train_step = ...
                targets += t.elts
            elif isinstance(t, ast.Attribute) and (t.attr in _STEP_METHODS or
                                                   (t.attr in methods and trainerish(t.value))):
                out.append(f"{_where(path, node.lineno)}: assigns {ast.unparse(t)}")
        if isinstance(node, ast.Call) and node.args:
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if func in _READERS:
                continue
            first = node.args[0]
            name = node.args[1] if len(node.args) > 1 else None
            if (trainerish(first) and isinstance(name, ast.Constant) and isinstance(name.value, str)
                    and name.value in methods):
                out.append(f"{_where(path, node.lineno)}: {func}({ast.unparse(first)}, {name.value!r}, ...) "
                           "replaces a Trainer method")
            elif (func in ("setattr", "patch") and isinstance(first, ast.Constant) and isinstance(first.value, str)
                  and re.search(r"\bTrainer\.\w+$", first.value) and first.value.rpartition(".")[2] in methods):
                # monkeypatch.setattr("dufu.engine.trainer.Trainer.train_step", ...), mock.patch("...")
                out.append(f"{_where(path, node.lineno)}: {func}({first.value!r}, ...) replaces a Trainer method")
    return sorted(out, key=lambda line: int(line.split(":")[1]))


def test_nothing_assigns_to_a_trainers_methods():
    methods = _trainer_method_names()
    this = Path(__file__).resolve()
    out = []
    for top in ("dufu", "tests", "benchmarks"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.resolve() != this:
                out += _patches_of_trainer(path, methods)
    _report(out, "(j) Trainer methods replaced (house style 9: register a hook at one of the loop's named points "
                 "instead, dufu.engine.hooks)")
