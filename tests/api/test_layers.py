"""The import graph of dnngraph runs one way down (DESIGN.md section 2): no circle, and no module
imports a module of a higher layer.

The graph is read from the source with `ast`, not by importing: every `import` and `from ... import`
of a dnngraph module counts, at module level and inside functions alike (a lazy import is an
arrow all the same). Relative imports are resolved to module names; `from pkg import name` is an
arrow to `pkg.name` when that is a module, else to `pkg` (so `from .. import __version__` is an
arrow to the package `dnngraph` itself). Two kinds of import are left out, since neither runs
an arrow through the code:
  * imports under `if TYPE_CHECKING:` (type annotations only; they never run);
  * the implicit import of a module's parent packages (importing `dnngraph.runtime.plan_cache` runs
    `dnngraph/__init__.py` and `dnngraph/runtime/__init__.py` first; that is Python's doing, and a
    package and its modules import each other by construction).
"""
from __future__ import annotations

import ast
import re
import pathlib

import networkx as nx

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "dnngraph"

# Layers, bottom (0) to top. A module may import its own layer and the ones below, never above.
# Each entry is a module or a package prefix (every module under it); the longest match wins.
# "dnngraph" itself (the package's __init__, the public API) matches only itself.
LAYERS = {
    # 0 base: no dnngraph imports but each other. target: the device model (plain data);
    # runtime: the CUDA-or-interpreter choice, made before any kernel is decorated.
    "dnngraph.errors": 0, "dnngraph.dtypes": 0, "dnngraph.log": 0, "dnngraph.versions": 0,
    "dnngraph.target": 0, "dnngraph.runtime.interpreter": 0, "dnngraph.runtime.interpreter_casts": 0,
    "dnngraph.dag": 0,  # topological orders (in place of networkx, which a build does not import)
    "dnngraph.ragged": 0,  # packed (THD) sdpa operands: offset checks and unpacking, in torch
    "dnngraph.bitpack": 0,  # bit-packed booleans: torch conversions and where they may appear
    # 1 IR: tensor values (Node and Graph are named only as types, under TYPE_CHECKING)
    "dnngraph.tensor": 1,
    "dnngraph.symbolic": 1,  # dynamic extents (dg.dynamic) and their propagation through shape rules
    # 2 the op catalog, and the JSON codec of graphs written with it (it fills the graph object
    #   it is handed; the plan cache keys plans on the document)
    "dnngraph.ops": 2, "dnngraph.serialization": 2,
    # 3 fusion: partition into kernel groups
    "dnngraph.fusion": 3,
    # 4 problems: one backend-neutral description per fused group (plain data read from the graph
    #   and the group; no runtime module either: tests/backends/test_backends.py checks); the
    #   runtime: kernel files, launches and their bindings, workspaces, the plan and its cache,
    #   autotuning's timings, the interpreter process (it launches Triton JITFunctions and times
    #   them, but renders and chooses nothing)
    "dnngraph.problems": 4, "dnngraph.runtime": 4,
    # 5 backends: the contract, the registry, and per kernel language configs and their ranking,
    #   kernel source, lowering a group to launches; BuildOptions holds the backends' forced
    #   configs and preference order
    "dnngraph.backends": 5, "dnngraph.options": 5,
    # 6 the build: partition -> problems -> choose a backend -> lower -> plan
    "dnngraph.build": 6,
    "dnngraph.shipping": 6,  # built plans as bytes and back (Graph.serialize / deserialize)
    # 7 what Graph's methods hand work to: reverse mode (it builds graphs of its input's type),
    #   the torch function, the dot text
    "dnngraph.autodiff": 7, "dnngraph.function": 7, "dnngraph.dot": 7,
    "dnngraph.rnn_network": 7,  # g.rnn's layers and directions written as graph ops
    # 8 the user-facing Graph: build, execute, explain, to_json/from_json, as_function all
    #   delegate downward
    "dnngraph.graph": 8,
    "dnngraph.frontend": 8,  # the cuDNN frontend's spellings, which graph.py applies to Graph
    # 9 entry points on top of Graph: the public package, torch.compile's backend, the CLI
    "dnngraph": 9, "dnngraph.torch_backend": 9, "dnngraph.__main__": 9,
    "dnngraph.graph_cache": 9,  # dnngraph.jit: graphs declared by a function, built once per key
}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(module: str) -> list[tuple[str, int]]:
    """(imported dnngraph module, line) for every import in `module`'s source."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for statement in child.orelse:
                    visit(statement)
                continue
            if isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[:len(package.split(".")) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module
                for alias in child.names:
                    sub = f"{target}.{alias.name}"
                    found.append((sub if sub in MODULES else target, child.lineno))
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return [(name, line) for name, line in found if name == "dnngraph" or name.startswith("dnngraph.")]


def import_graph() -> nx.DiGraph:
    graph = nx.DiGraph()
    graph.add_nodes_from(MODULES)
    for module in MODULES:
        for target, line in imports_of(module):
            if target != module:
                graph.add_edge(module, target)
                graph.edges[module, target].setdefault("lines", []).append(line)
    return graph


def layer_of(module: str):
    matches = [prefix for prefix in LAYERS
               if module == prefix or (prefix != "dnngraph" and module.startswith(prefix + "."))]
    return LAYERS[max(matches, key=len)] if matches else None


def where(graph, module, target) -> str:
    lines = ",".join(str(line) for line in sorted(set(graph.edges[module, target]["lines"])))
    return f"{MODULES[module].relative_to(PACKAGE.parent)}:{lines}"


def test_every_module_has_a_layer():
    unplaced = [m for m in MODULES if layer_of(m) is None]
    assert not unplaced, f"add these modules to LAYERS: {unplaced}"


def test_every_import_target_exists():
    graph = import_graph()
    missing = [f"{where(graph, m, t)} imports {t}" for m, t in graph.edges if t not in MODULES]
    assert not missing, "\n" + "\n".join(missing)


def test_no_import_cycle():
    graph = import_graph()
    cycles = []
    for component in nx.strongly_connected_components(graph):
        if len(component) > 1:
            cycle = nx.find_cycle(graph.subgraph(component))
            cycles.append(f"{len(component)} modules in a circle, e.g. "
                          + " -> ".join(f"{a} ({where(graph, a, b)})" for a, b in cycle)
                          + f" -> {cycle[0][0]}")
    assert not cycles, "\n" + "\n".join(cycles)


def test_no_import_runs_up_a_layer():
    graph = import_graph()
    upward = [f"{where(graph, module, target)}: {module} (layer {layer_of(module)}) imports "
              f"{target} (layer {layer_of(target)})"
              for module, target in sorted(graph.edges)
              if layer_of(target) is not None and layer_of(module) is not None
              and layer_of(target) > layer_of(module)]
    assert not upward, "\n" + "\n".join(upward)


def test_the_checker_sees_lazy_and_relative_imports():
    """imports_of finds function-level and relative imports and skips TYPE_CHECKING blocks."""
    found = dict(imports_of("dnngraph.graph"))
    assert "dnngraph.build" in found and "dnngraph.serialization" in found  # lazy, in methods
    assert "dnngraph.graph" not in dict(imports_of("dnngraph.tensor"))    # TYPE_CHECKING only
    assert layer_of("dnngraph.runtime.plan_cache") == LAYERS["dnngraph.runtime"]
    assert layer_of("dnngraph") == 9 and layer_of("dnngraph.ops.matmul") == 2


# Paths of modules that moved when the layers were drawn (plan/ split into build.py, runtime/
# and backends/triton/lower/; codegen/ and heuristics/ went under backends/triton/).
_MOVED = re.compile(r"(?<![\w/.])(plan/\w+\.py|plan/__init__|codegen/cache\.py|heuristics/(autotune|tuning_cache|workspace)"
                    r"\.py|dnngraph\.(plan|codegen|heuristics)\b|dnngraph/(plan|codegen|heuristics)/)")


def test_no_text_names_a_module_where_it_used_to_be():
    """Comments, docstrings, strings and docs name modules where they are (the history of
    benchmarks excepted): a stale path sends a reader, or a generated import, nowhere."""
    root = PACKAGE.parent
    paths = [p for p in root.glob("dnngraph/**/*.py")] + [p for p in root.glob("tests/**/*.py")]
    paths += [p for p in root.glob("benchmarks/*.py")] + [root / "README.md", root / "docs" / "ARCHITECTURE.md",
                                                           root / "BENCHMARKS.md"]
    stale = [f"{p.relative_to(root)}:{n}: {m.group(0)}" for p in paths if p.name != "test_layers.py"
             for n, line in enumerate(p.read_text().splitlines(), 1) for m in [_MOVED.search(line)] if m]
    assert not stale, "\n".join(stale)


_TEST_PATH = re.compile(r"(?<![\w/.])tests/[a-z0-9_/]+\.py")


def test_every_test_path_named_in_text_is_there():
    """A `tests/...py` named in code, docs or scripts exists (the tests sit in one folder per
    layer, tests/ir, tests/ops, ...; the helper modules in tests/ itself): a command copied from
    the docs runs, a reader finds the file (the history of benchmarks excepted)."""
    root = PACKAGE.parent
    paths = [p for p in root.glob("dnngraph/**/*.py")] + [p for p in root.glob("tests/**/*.py")]
    paths += [p for p in root.glob("benchmarks/*.py")] + [p for p in root.glob("benchmarks/*.sh")]
    paths += [root / "README.md", root / "docs" / "ARCHITECTURE.md", root / "BENCHMARKS.md", root / ".ci" / "run"]
    missing = [f"{p.relative_to(root)}:{n}: {m.group(0)}" for p in paths
               for n, line in enumerate(p.read_text().splitlines(), 1) for m in _TEST_PATH.finditer(line)
               if not (root / m.group(0)).is_file()]
    assert not missing, "\n".join(missing)


def test_the_build_reaches_backends_only_through_the_contract_and_the_registry():
    """build.py names no kernel language: a backend is chosen by the registry and lowers a group
    through the contract (a second code generator is one folder and one registry line)."""
    into_backends = {target for target, _ in imports_of("dnngraph.build") if target.startswith("dnngraph.backends")}
    assert into_backends <= {"dnngraph.backends.contract", "dnngraph.backends.registry", "dnngraph.backends"}, \
        into_backends
