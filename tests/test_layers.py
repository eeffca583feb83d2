"""The import layering of the project's own packages, checked statically (stdlib ``ast`` only).

Layers, bottom to top; a module may import from its own tier or any tier below, never above:

- tier 0: ``miles_k3.ops``, ``miles_k3.kernels``, ``miles_k3.rpc`` and every module directly in
  ``miles_k3/`` (``miles_k3/__init__.py``)
- tier 1: ``miles_k3.model``, ``miles_k3.compat``
- tier 2: ``megatron_patches``, ``rollout``, ``miles_k3.data``, ``miles_k3.algo``, ``miles_k3.rewards``,
  ``miles_k3.tasks``
- tier 3: ``miles_k3.trainer``
- tier 4: ``miles_k3.cli``

Every ``import``/``from ... import`` statement anywhere in a module counts: top level, inside functions and
classes, under ``try:`` and under ``if TYPE_CHECKING:``. TYPE_CHECKING imports are kept on purpose: they do
not run, but they still say that the importing module is written against the imported one, which is exactly
the dependency the layering is about (and a TYPE_CHECKING import is how a real upward import usually starts).
Dynamic imports (``importlib.import_module(name)``) are not visible to the AST and are not checked.
Imports of anything outside the project's packages (torch, the stdlib, ...) are ignored.

Import cycles (strongly connected components of the module graph, function-level imports included) must be
named in docs/design.md, section ``## Layers and import cycles``, one bullet each::

    - `pkg.a` <-> `pkg.b`: why this cycle is acceptable

A bullet allows exactly the component whose module set equals the bullet's; a bullet whose cycle is gone fails
too, so the notes stay true.
"""

from __future__ import annotations

import ast
import re
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("miles_k3", "megatron_patches", "rollout")
DESIGN_NOTES = REPO / "docs" / "design.md"
CYCLES_HEADING = "## Layers and import cycles"

# Longest prefix wins. ``miles_k3`` itself covers only the modules directly in miles_k3/ (SHALLOW), so a new
# subpackage of it is in no layer until placed here; megatron_patches and rollout cover all their subpackages.
LAYERS: dict[str, int] = {
    "miles_k3": 0,
    "miles_k3.ops": 0,
    "miles_k3.kernels": 0,
    "miles_k3.rpc": 0,  # new bottom module; may not exist yet, which is fine
    "miles_k3.model": 1,
    "miles_k3.compat": 1,
    "megatron_patches": 2,
    "rollout": 2,
    "miles_k3.data": 2,
    "miles_k3.algo": 2,
    "miles_k3.rewards": 2,
    "miles_k3.tasks": 2,
    "miles_k3.trainer": 3,
    "miles_k3.cli": 4,
}
SHALLOW = {"miles_k3"}


# ----------------------------------------------------------------------------------------------------------
# The checker


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    is_package: bool


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    path: Path
    line: int
    target: str  # the imported project module (resolved)


def collect_modules(root: Path, packages=PACKAGES) -> dict[str, Module]:
    """Every .py file of the given top-level packages under root, by dotted module name."""
    modules: dict[str, Module] = {}
    for pkg in packages:
        base = root / pkg
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            modules[".".join(parts)] = Module(".".join(parts), path, is_package)
    return modules


def _is_project(name: str, packages=PACKAGES) -> bool:
    return name.split(".", 1)[0] in packages


def imports_of(mod: Module, source: str, modules, packages=PACKAGES) -> list[tuple[int, str]]:
    """(line, target module) for every import of a project module anywhere in ``source``.

    ``import a.b.c`` imports a.b.c; ``from pkg import name`` imports pkg.name when that is a module, else pkg.
    Relative imports are resolved against mod's package. A target that does not exist (yet) keeps its name,
    so its tier is still known; it is simply not a node of the cycle graph. (The implicit import of parent
    packages, whose __init__ runs first, is not added as an edge: a package's __init__ is its own module.)
    """
    out: list[tuple[int, str]] = []
    tree = ast.parse(source, filename=str(mod.path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_project(alias.name, packages):
                    out.append((node.lineno, alias.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg_parts = mod.name.split(".") if mod.is_package else mod.name.split(".")[:-1]
                up = node.level - 1
                if up > len(pkg_parts) - 1:
                    raise ValueError(f"{mod.path}:{node.lineno}: relative import beyond the top-level package")
                pkg_parts = pkg_parts[: len(pkg_parts) - up]
                base = ".".join(pkg_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if not _is_project(base, packages):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if alias.name != "*" and sub in modules:
                    out.append((node.lineno, sub))
                else:
                    out.append((node.lineno, base))
    return sorted(set(out))


def collect_imports(root: Path, packages=PACKAGES) -> tuple[dict[str, Module], list[Import]]:
    modules = collect_modules(root, packages)
    found = []
    for mod in modules.values():
        for line, target in imports_of(mod, mod.path.read_text(encoding="utf-8"), modules, packages):
            found.append(Import(mod.name, mod.path, line, target))
    return modules, found


def tier_of(name: str, layers=LAYERS) -> int | None:
    """The tier of a module, or None when no layer covers it (a new subpackage must be given one)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in layers:
            # "miles_k3" covers only the package itself and the modules directly in it
            if prefix in SHALLOW and len(parts) > 2:
                return None
            return layers[prefix]
    return None


def _rel(path: Path, root: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return path.as_posix()


def upward_imports(root: Path, imports: list[Import], layers=LAYERS) -> list[str]:
    bad = []
    for imp in imports:
        own, target = tier_of(imp.module, layers), tier_of(imp.target, layers)
        if own is not None and target is not None and target > own:
            bad.append(
                f"{_rel(imp.path, root)}:{imp.line}: {imp.module} (tier {own}) imports {imp.target} (tier {target})"
            )
    return bad


def import_graph(modules, imports: list[Import]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for imp in imports:
        if imp.target in modules:
            graph[imp.module].add(imp.target)
    return graph


def strongly_connected_components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (no recursion limit to worry about)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    sccs: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    scc = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        scc.append(member)
                        if member == node:
                            break
                    sccs.append(sorted(scc))
    return sccs


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """SCCs of more than one module, and modules that import themselves."""
    return sorted(scc for scc in strongly_connected_components(graph) if len(scc) > 1 or scc[0] in graph[scc[0]])


def example_cycle(graph: dict[str, set[str]], scc: list[str]) -> list[str]:
    """A shortest cycle through the SCC's first module, staying inside the SCC: [a, b, ..., a]."""
    members, start = set(scc), scc[0]
    prev: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph[node] & members):
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                return [start] + path[::-1][1:] + [start] if node != start else [start, start]
            if child not in prev:
                prev[child] = node
                queue.append(child)
    raise AssertionError(f"no cycle through {start} in {scc}")


_BULLET = re.compile(r"^- (`[^`\s]+`(?: <-> `[^`\s]+`)+)\s*:\s*(\S.*)$")


def named_cycles(design_text: str) -> tuple[list[tuple[frozenset[str], str]], list[str]]:
    """The allowed cycles of the design notes' section, and the lines there that look like cycle bullets
    but are not well formed. A missing section means no cycle is allowed."""
    allowed, malformed = [], []
    inside = fenced = False
    for raw in design_text.splitlines():
        line = raw.rstrip()
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        heading = re.match(r"^(#+) ", line)
        if heading and len(heading.group(1)) <= 2:  # a ### sub-heading stays inside the section
            inside = line.strip() == CYCLES_HEADING
            continue
        if not inside:
            continue
        match = _BULLET.match(line)
        if match:
            allowed.append((frozenset(re.findall(r"`([^`]+)`", match.group(1))), line))
        elif "<->" in line and line.lstrip().startswith(("-", "*")):
            malformed.append(line)
    return allowed, malformed


# ----------------------------------------------------------------------------------------------------------
# Running it on the tree (parsed once per session)


@dataclass(repr=False)
class Report:
    modules: dict[str, Module]
    imports: list[Import]
    graph: dict[str, set[str]]
    cycles: list[list[str]]
    allowed: list[tuple[frozenset[str], str]]
    malformed: list[str]

    def __repr__(self) -> str:  # keeps pytest's failure output to the message
        return f"Report({len(self.modules)} modules, {len(self.imports)} imports, {len(self.cycles)} cycles)"


def analyse(root: Path, design: Path | None, packages=PACKAGES) -> Report:
    modules, imports = collect_imports(root, packages)
    graph = import_graph(modules, imports)
    text = design.read_text(encoding="utf-8") if design is not None and design.exists() else ""
    allowed, malformed = named_cycles(text)
    return Report(modules, imports, graph, import_cycles(graph), allowed, malformed)


def unnamed_cycles(report: Report) -> list[str]:
    allowed = {names for names, _ in report.allowed}
    return [
        f"cycle over {len(scc)} module(s): {', '.join(scc)}\n    e.g. {' -> '.join(example_cycle(report.graph, scc))}"
        for scc in report.cycles
        if frozenset(scc) not in allowed
    ]


def stale_bullets(report: Report) -> list[str]:
    current = {frozenset(scc) for scc in report.cycles}
    out = []
    for names, line in report.allowed:
        if names in current:
            continue
        overlapping = ["{" + ", ".join(scc) + "}" for scc in report.cycles if names & set(scc)]
        hint = f" (its modules are now in: {'; '.join(overlapping)})" if overlapping else ""
        out.append(f"{line}\n    no import cycle is exactly {{{', '.join(sorted(names))}}}{hint}")
    return out


@pytest.fixture(scope="module")
def tree() -> Report:
    return analyse(REPO, DESIGN_NOTES)


# ----------------------------------------------------------------------------------------------------------
# The project's layering


def test_every_module_belongs_to_a_layer(tree):
    unassigned = sorted(name for name in tree.modules if tier_of(name) is None)
    assert not unassigned, (
        "modules in no layer (add their package to LAYERS in tests/test_layers.py and to "
        "the design notes):\n" + "\n".join(unassigned)
    )


def test_no_module_imports_a_layer_above_its_own(tree):
    bad = upward_imports(REPO, tree.imports)
    assert not bad, f"{len(bad)} import(s) from a layer above the importer's own:\n" + "\n".join(bad)


def test_every_import_cycle_is_named_in_the_design_notes(tree):
    bad = unnamed_cycles(tree)
    assert not bad, f"{len(bad)} import cycle(s) not named in docs/design.md ('{CYCLES_HEADING}'):\n" + "\n".join(bad)


def test_named_cycles_still_exist(tree):
    bad = [f"malformed cycle bullet (want - `a` <-> `b`: reason): {line}" for line in tree.malformed]
    bad += stale_bullets(tree)
    assert not bad, "docs/design.md names import cycles that do not exist:\n" + "\n".join(bad)


# ----------------------------------------------------------------------------------------------------------
# The checker itself, on a synthetic tree, so the checks above are known to be able to fail


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_the_checker_catches_a_function_level_upward_import_and_a_cycle(tmp_path):
    _write(
        tmp_path,
        {
            "miles_k3/__init__.py": "",
            "miles_k3/ops/__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from ..model import layers\n",
            "miles_k3/ops/norm.py": "import torch\n\n\ndef f():\n    from miles_k3.trainer import loop\n"
            "    return loop\n",
            "miles_k3/model/__init__.py": "",
            "miles_k3/model/layers.py": "from ..ops import norm\nfrom . import layers\n",
            "miles_k3/trainer/__init__.py": "",
            "miles_k3/trainer/loop.py": "from miles_k3.ops.norm import f\nimport miles_k3.rpc\n",
            "rollout/__init__.py": "from miles_k3 import trainer\nimport miles_k3.cli.main\n",
        },
    )
    report = analyse(tmp_path, None)

    assert upward_imports(tmp_path, report.imports) == [
        "miles_k3/ops/__init__.py:3: miles_k3.ops (tier 0) imports miles_k3.model.layers (tier 1)",
        "miles_k3/ops/norm.py:5: miles_k3.ops.norm (tier 0) imports miles_k3.trainer.loop (tier 3)",
        "rollout/__init__.py:1: rollout (tier 2) imports miles_k3.trainer (tier 3)",
        "rollout/__init__.py:2: rollout (tier 2) imports miles_k3.cli.main (tier 4)",  # missing, still counts
    ]
    assert report.cycles == [["miles_k3.model.layers"], ["miles_k3.ops.norm", "miles_k3.trainer.loop"]]
    assert example_cycle(report.graph, report.cycles[0]) == ["miles_k3.model.layers", "miles_k3.model.layers"]
    assert example_cycle(report.graph, report.cycles[1]) == [
        "miles_k3.ops.norm",
        "miles_k3.trainer.loop",
        "miles_k3.ops.norm",
    ]
    assert len(unnamed_cycles(report)) == 2

    # naming the two-module cycle allows it; a bullet for a cycle that is not there is stale
    report.allowed, report.malformed = named_cycles(
        "# Notes\n\n## Layers and import cycles\n\n"
        "- `miles_k3.trainer.loop` <-> `miles_k3.ops.norm`: a test\n"
        "- `miles_k3.ops` <-> `miles_k3.model`: gone\n"
        "- `miles_k3.ops` <-> `miles_k3.model` no reason\n\n"
        "## Next\n\n- `rollout` <-> `miles_k3`: outside the section, ignored\n"
    )
    assert [u.splitlines()[0] for u in unnamed_cycles(report)] == ["cycle over 1 module(s): miles_k3.model.layers"]
    assert [s.splitlines()[0] for s in stale_bullets(report)] == ["- `miles_k3.ops` <-> `miles_k3.model`: gone"]
    assert report.malformed == ["- `miles_k3.ops` <-> `miles_k3.model` no reason"]


def test_tiers_follow_the_layer_list():
    assert tier_of("miles_k3") == 0
    assert tier_of("miles_k3.rpc") == 0
    assert tier_of("miles_k3.kernels.norm") == 0
    assert tier_of("miles_k3.model.config") == 1
    assert tier_of("rollout.server.app") == 2
    assert tier_of("miles_k3.tasks.arithmetic") == 2
    assert tier_of("miles_k3.trainer.loop") == 3
    assert tier_of("miles_k3.cli.main") == 4
    assert tier_of("miles_k3.newpkg.thing") is None  # a subpackage nobody placed
