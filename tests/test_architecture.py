"""The layers of ``nanolab/`` only point down, and no modules import each other in a circle.

The layers are the table in docs/architecture.md (the one place they are written down): a module
may import its own layer and the layers below it; in the ``tools`` layer each tool stands on its
own (no tool imports another). Every import counts, including those inside functions (the ones a
module makes lazily to start fast) and ``importlib.import_module("...")`` with a literal name.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nanolab"
DOC = ROOT / "docs" / "architecture.md"
#: Files written into a fork's project (``nanolab init``): not nanolab's own modules.
NOT_MODULES = ("templates",)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if any(part in NOT_MODULES for part in path.relative_to(PACKAGE).parts):
            continue
        found[module_name(path)] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(imported nanolab module, line) for every import in the file, at any depth."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: list[tuple[str, int]] = []

    def add(target: str, line: int) -> None:
        while target and target not in known:  # ``from nanolab.x import name`` -> nanolab.x
            target = target.rpartition(".")[0]
        if target:
            targets.append((target, line))

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("nanolab"):
                    add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not source.startswith("nanolab"):
                continue
            for alias in node.names:  # ``from nanolab.run import cli`` imports nanolab.run.cli
                sub = f"{source}.{alias.name}"
                add(sub if sub in known else source, node.lineno)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).startswith("nanolab")
        ):
            add(str(node.args[0].value), node.lineno)
    return [(t, line) for t, line in targets if t != name]


def layers_from_doc() -> list[tuple[str, list[str]]]:
    """``[(layer, [module prefixes])]`` from the table in docs/architecture.md, bottom first."""
    rows = []
    for line in DOC.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^\|\s*(\d+)\s*\|\s*`?(\w+)`?\s*\|([^|]*)\|", line)
        if m:
            prefixes = re.findall(r"`(nanolab[\w./]*)`", m.group(3))
            rows.append(
                (int(m.group(1)), m.group(2), [p.strip("/").replace("/", ".") for p in prefixes])
            )
    rows.sort()
    assert rows, "docs/architecture.md has no layer table"
    assert [r[0] for r in rows] == list(range(1, len(rows) + 1)), "layers are numbered 1, 2, ..."
    return [(layer, [p.removesuffix(".py") for p in prefixes]) for _, layer, prefixes in rows]


def place(name: str, layers: list[tuple[str, list[str]]]) -> tuple[int, str] | None:
    """(layer index, the unit within it) of a module: the longest prefix that names it."""
    best: tuple[int, int, str] | None = None
    for index, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            if prefix.endswith(".__init__"):  # the package's own __init__.py, not its contents
                if name == prefix.removesuffix(".__init__"):
                    return index, prefix
                continue
            if (name == prefix or name.startswith(prefix + ".")) and (
                best is None or len(prefix) > best[1]
            ):
                best = (index, len(prefix), prefix)
    return None if best is None else (best[0], best[2])


def graph() -> dict[str, list[tuple[str, int]]]:
    found = modules()
    return {name: imports_of(name, path, set(found)) for name, path in found.items()}


def test_every_module_has_a_layer() -> None:
    layers = layers_from_doc()
    homeless = [name for name in modules() if place(name, layers) is None]
    assert not homeless, f"modules in no layer of docs/architecture.md: {homeless}"


def test_imports_only_point_down() -> None:
    layers = layers_from_doc()
    tools = next(i for i, (layer, _) in enumerate(layers) if layer == "tools")
    wrong = []
    for name, targets in graph().items():
        here, unit = place(name, layers)  # type: ignore[misc]
        for target, line in targets:
            there, other = place(target, layers)  # type: ignore[misc]
            if there > here:
                wrong.append(
                    f"{name}:{line} imports {target} ({layers[here][0]} -> {layers[there][0]})"
                )
            elif there == here == tools and unit != other:
                wrong.append(f"{name}:{line} imports {target} (one tool -> another)")
    assert not wrong, "imports that run upward or sideways:\n  " + "\n  ".join(wrong)


def test_no_import_cycles() -> None:
    edges = {name: {t for t, _ in targets} for name, targets in graph().items()}
    # A package's __init__ that only re-exports its modules is not a cycle with them.
    cycles, state, stack = [], defaultdict(int), []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt.startswith(node + "."):  # a package importing its own modules
                continue
            if state[nxt] == 1:
                cycles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif state[nxt] == 0:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if state[node] == 0:
            visit(node)
    assert not cycles, "import cycles:\n  " + "\n  ".join(cycles)


def test_the_rule_catches_an_upward_import(tmp_path: Path) -> None:
    """The parser sees a function-local import and a relative one (the test can fail)."""
    source = tmp_path / "mod.py"
    source.write_text(
        "def f():\n    from nanolab.queue.cli import main\n\nfrom ..runs import read_run\n"
    )
    known = {"nanolab.queue.cli", "nanolab.runs", "nanolab.callbacks.mod"}
    found = imports_of("nanolab.callbacks.mod", source, known)
    assert ("nanolab.queue.cli", 2) in found
    assert ("nanolab.runs", 4) in found
    layers = layers_from_doc()
    assert place("nanolab.callbacks.mod", layers)[0] < place("nanolab.queue.cli", layers)[0]
