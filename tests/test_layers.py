"""thunder_tp's import graph keeps its layers (docs/design.md "The folders"): the pipeline's stages in order (front,
analysis, rewrite, execution, ...) and what is built on them; no circle among the imports a module runs when it is
imported, and no module imports a layer above its own. In benchmarks/, ``benchmarks/lib`` is the only
shared layer: no other benchmark module is imported by one, and nothing imports tests/. Outside thunder_tp/layouts.py
no module tests a layout for `StackShard` by type (it asks the layout, e.g. ``layout.owner(size)``). Read from the
source with ast; nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "thunder_tp"
BENCHMARKS = PACKAGE.parent / "benchmarks"

# The layers, bottom to top: the pipeline's stages in order, then what is built on them. A module may import its own
# layer and the ones below it; it belongs to the layer of the longest prefix listed here (every module not listed
# with its own prefix is the vocabulary, layer 0: layouts, pieces, costs, ops, thunder_internals).
LAYERS: dict[str, int] = {
    "thunder_tp": 0,  # the vocabulary: layouts, pieces, the cost model, thunder_tp's own symbols, Thunder's internals
    "thunder_tp.collectives": 1,  # how the ranks run, collective symbols, their grads and lowering, annotate()
    "thunder_tp.styles": 2,  # the front: styles, plan matching, DTensor's spellings
    "thunder_tp.families": 2,  # the registry through which model families hook into the stages
    "thunder_tp.propagation": 3,  # the analysis: constraints and propagation
    "thunder_tp.rewriting": 4,  # the rewrite: what a program communicates, ops on local pieces
    "thunder_tp.tracing": 4,  # the shortcuts through Thunder's tracing: blocks traced once, regions compiled once
    "thunder_tp.execution": 5,  # the fusion executor and its passes
    "thunder_tp.runtimes": 5,  # the decode step, the ranks' agreement checks
    "thunder_tp.models": 6,  # the model families, which register themselves into the stages
    "thunder_tp.plans": 7,  # the plans: plans.litgpt, plans.hf on the families, plans.auto searched (plans/search/)
    "thunder_tp.transform": 8,  # TensorParallel: drives the stages on each trace
    "thunder_tp.composition": 8,  # the transform's checks of its place among Thunder's DDP / FSDP transforms
    "thunder_tp.context_parallel": 9,  # ContextParallel: a TensorParallel over the sequence
    "thunder_tp.tools": 9,  # simulate, one_rank, debug, clipping: around a TensorParallel program
    "thunder_tp.data_parallel": 9,  # 2-D meshes, parallelize()
    "thunder_tp.checkpoint": 9,  # DCP save / load of TensorParallel programs
    "thunder_tp.__init__": 10,  # the public API: the package itself, above everything it gathers
    "thunder_tp.generate": 11,  # the generation CLI and what it runs (generation.py)
    "thunder_tp.fabric": 11,  # Lightning Fabric's ThunderTPStrategy, a user of the public API
}
LAYER_NAMES = {0: "vocabulary", 1: "collectives", 2: "front", 3: "analysis", 4: "rewrite / tracing", 5: "execution",
               6: "models", 7: "plans", 8: "transform", 9: "tools / 2-D / checkpoint", 10: "the package __init__",
               11: "generate / fabric"}


def module_name(path: Path) -> str:
    """``thunder_tp/a/b.py`` -> ``thunder_tp.a.b``; a package's ``__init__.py`` -> the package."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_package(name: str) -> bool:
    """Whether ``name`` is a package (a folder with ``__init__.py``) of thunder_tp."""
    return (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()


def known_module(name: str) -> bool:
    """Whether ``name`` is a module or package of thunder_tp."""
    path = PACKAGE.parent / name.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def layer_of(name: str) -> int:
    """The layer of module ``name`` (the package itself is its ``__init__``)."""
    if name == "thunder_tp":
        return LAYERS["thunder_tp.__init__"]
    prefix = max((p for p in LAYERS if name == p or name.startswith(p + ".")), key=len)
    return LAYERS[prefix]


def imported_modules(node: ast.Import | ast.ImportFrom, importer: str) -> list[str]:
    """The thunder_tp modules an import statement in module ``importer`` runs."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.split(".")[0] == "thunder_tp"]
    if node.level:  # relative: resolved against the importer's package
        package = importer if is_package(importer) else importer.rpartition(".")[0]
        base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([node.module] if node.module
                                                                                          else []))
    else:
        base = node.module or ""
    if base.split(".")[0] != "thunder_tp":
        return []
    # `from pkg import sub` runs the submodule; `from pkg import name` runs pkg's __init__
    names = [f"{base}.{alias.name}" for alias in node.names]
    return [name if known_module(name) else base for name in names]


def module_level(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The imports that run when the module is imported: everywhere but inside functions."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            todo.extend(ast.iter_child_nodes(node))
    return found


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Per module: the modules it imports at module level, and the ones it imports anywhere (functions included)."""
    eager, every = {}, {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        tree = ast.parse(path.read_text(), filename=str(path))
        imports = [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
        every[name] = {m for node in imports for m in imported_modules(node, name)} - {name}
        eager[name] = {m for node in module_level(tree) for m in imported_modules(node, name)} - {name}
    return eager, every


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` as a list of modules (its first repeated at the end), or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[module] = "done"
        stack.pop()
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module from a layer above the importer's, as ``importer (layer) -> imported (layer)``."""
    return [f"{importer} ({LAYER_NAMES[layer_of(importer)]}) -> {target} ({LAYER_NAMES[layer_of(target)]})"
            for importer, targets in sorted(graph.items()) for target in sorted(targets)
            if layer_of(target) > layer_of(importer)]


def test_no_circle_at_module_level():
    eager, _ = import_graph()
    cycle = find_cycle(eager)
    assert cycle is None, "modules import each other in a circle: " + " -> ".join(cycle)


def test_nothing_imports_upwards():
    _, every = import_graph()
    assert not upward_imports(every), "imports of a layer above the importer's:\n" + "\n".join(upward_imports(every))


@pytest.mark.parametrize("importer, target", [("thunder_tp.layouts", "thunder_tp.models.litgpt"),
                                              ("thunder_tp.propagation.engine", "thunder_tp.rewriting.program"),
                                              ("thunder_tp.collectives.symbols", "thunder_tp.tools.simulate"),
                                              ("thunder_tp.execution.executor", "thunder_tp.transform"),
                                              ("thunder_tp.tracing.repeated_blocks", "thunder_tp.execution.executor"),
                                              ("thunder_tp.models.moe", "thunder_tp.plans.hf"),
                                              ("thunder_tp.plans.litgpt", "thunder_tp.fabric.strategy"),
                                              ("thunder_tp.styles", "thunder_tp"),
                                              ("thunder_tp", "thunder_tp.generate")])
def test_a_planted_upward_import_is_found(importer, target):
    _, every = import_graph()
    assert upward_imports({**every, importer: every[importer] | {target}}) == [
        f"{importer} ({LAYER_NAMES[layer_of(importer)]}) -> {target} ({LAYER_NAMES[layer_of(target)]})"]


def test_a_planted_circle_is_found():
    eager, _ = import_graph()
    planted = {**eager, "thunder_tp.layouts": eager["thunder_tp.layouts"] | {"thunder_tp.transform"}}
    cycle = find_cycle(planted)
    assert cycle is not None and "thunder_tp.layouts" in cycle and "thunder_tp.transform" in cycle


def benchmark_sources() -> dict[str, str]:
    """The source of every module of benchmarks/, by module name."""
    return {module_name(path): path.read_text() for path in sorted(BENCHMARKS.rglob("*.py"))}


def _imported(node: ast.AST) -> list[str]:
    """The benchmarks/ and tests/ modules an import statement imports (``from pkg import sub``: the submodule)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        return sorted({f"{node.module}.{alias.name}" if known_module(f"{node.module}.{alias.name}") else node.module
                       for alias in node.names})
    return []


def benchmark_imports_outside_lib(sources: dict[str, str]) -> list[str]:
    """Every import in ``sources`` (module name -> source) of a benchmarks/ module outside benchmarks/lib or of a
    tests/ module, as ``importer -> imported``."""
    return [f"{importer} -> {target}" for importer, source in sources.items()
            for node in ast.walk(ast.parse(source)) for target in _imported(node)
            if target.split(".")[0] == "tests"
            or target.split(".")[0] == "benchmarks" and not (target + ".").startswith("benchmarks.lib.")]


def test_benchmarks_share_only_lib():
    found = benchmark_imports_outside_lib(benchmark_sources())
    assert not found, "benchmarks/ modules outside lib/ or tests/ imported in benchmarks/:\n" + "\n".join(found)


@pytest.mark.parametrize("line, target", [
    ("from benchmarks import bench_generate", "benchmarks.bench_generate"),
    ("from benchmarks.benchmark_litgpt import main", "benchmarks.benchmark_litgpt"),
    ("    from tests.dist import run_ranks", "tests.dist"),
    ("import benchmarks.projection.overlap", "benchmarks.projection.overlap")])
def test_a_planted_benchmark_import_is_found(line, target):
    source = f"def f():\n{line}\n" if line.startswith(" ") else line + "\n"
    sources = {**benchmark_sources(), "benchmarks.lib.planted": source}
    assert benchmark_imports_outside_lib(sources) == [f"benchmarks.lib.planted -> {target}"]



def stackshard_type_tests(sources: dict[str, str]) -> list[str]:
    """Every use of the class `StackShard` in ``sources`` (module name -> source) outside thunder_tp.layouts (which
    defines the layouts and the questions they answer) other than constructing one or a type hint, as ``module:line``:
    ``isinstance(x, StackShard)``, ``StackShard in (type(x), ...)``, ``case StackShard()``."""
    found = []
    for module, source in sources.items():
        if module == "thunder_tp.layouts":
            continue
        tree = ast.parse(source)
        allowed = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
        for hint in (h for n in ast.walk(tree) for h in (getattr(n, "annotation", None), getattr(n, "returns", None))):
            allowed |= {id(part) for part in ast.walk(hint)} if isinstance(hint, ast.AST) else set()
        found += [f"{module}:{n.lineno}" for n in ast.walk(tree) if id(n) not in allowed
                  and "StackShard" in (getattr(n, "id", None), getattr(n, "attr", None))]  # a Name, an Attribute
    return found


def package_sources() -> dict[str, str]:
    """The source of every module of thunder_tp, by module name."""
    return {module_name(path): path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}


def test_stackshard_is_tested_by_type_only_in_layouts():
    found = stackshard_type_tests(package_sources())
    assert not found, "StackShard tested by type outside layouts.py; ask the layout (e.g. layout.owner(size)):\n" + (
        "\n".join(found))


@pytest.mark.parametrize("body", ["if isinstance(layout, StackShard):\n        pass",
                                  "return isinstance(layout, (Shard, StackShard))",
                                  "return StackShard in (type(src), type(dst))",
                                  "return type(layout) is layouts.StackShard",
                                  "match layout:\n        case StackShard(index=0):\n            pass"])
def test_a_planted_stackshard_type_test_is_found(body):
    sources = package_sources()
    planted = sources["thunder_tp.pieces"] + f"\n\ndef planted(layout, src, dst):\n    {body}\n"
    line = next(i for i, text in enumerate(planted.splitlines(), 1) if "StackShard" in text)
    assert stackshard_type_tests({**sources, "thunder_tp.pieces": planted}) == [f"thunder_tp.pieces:{line}"]
