"""The package's layout: an import graph without cycles (imports inside functions included), parts
that import only from the layers below them (docs/architecture.md), a config schema that loads
nothing of podtrain but its errors, and models that know no mesh."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "podtrain"


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the podtrain modules it imports anywhere in its file (a package's __init__ counts
    for every module below it, as Python runs it first)."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("podtrain"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    edges.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name.startswith("podtrain"))
        for target in list(edges):  # importing a.b.c runs a and a.b first
            parts = target.split(".")
            edges.update(".".join(parts[:i]) for i in range(1, len(parts)))
        graph[name] = {e for e in edges if e in modules and e != name and not name.startswith(e + ".")}
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state and (found := visit(nxt, path + [node])):
                return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [])):
            return found
    return None


def test_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 30 and graph["podtrain.train.loop"], "the graph should see the whole package"
    found = cycle(graph)
    assert found is None, "import cycle: " + " -> ".join(found)


def test_cycle_finder_finds_a_cycle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


# The parts of podtrain (a top-level module or subpackage), bottom first: a part imports only from
# the layers below its own, never from its own layer's other parts or from above.
LAYERS = (
    ("errors",),
    ("axes", "trees", "storage", "sharding"),
    ("config",),
    ("runtime", "models", "data"),
    ("interop",),
    ("program",),
    ("planning",),
    ("train",),
    ("tools",),
    ("api",),
    ("cli",),
    ("__main__",),
)


def _part(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a module from a part of its own layer or above, as 'a -> b'."""
    layer = {part: i for i, parts in enumerate(LAYERS) for part in parts}
    wrong = []
    for name, targets in sorted(graph.items()):
        me = _part(name)
        for target in sorted(targets):
            other = _part(target)
            if other not in (me, "podtrain") and layer[other] >= layer[me]:
                wrong.append(f"{name} -> {target}")
    return wrong


def test_every_part_is_in_a_layer():
    parts = {_part(name) for name in import_graph()} - {"podtrain"}
    assert parts == {p for layer in LAYERS for p in layer}


def test_parts_import_only_from_the_layers_below_them():
    wrong = upward_imports(import_graph())
    assert not wrong, "imports up the layers (docs/architecture.md): " + ", ".join(wrong)


def test_an_import_up_the_layers_or_across_one_is_found():
    graph = {
        "podtrain.models.llama": {"podtrain.config.schema", "podtrain.program.job"},
        "podtrain.data.text": {"podtrain.models.llama"},
        "podtrain.train.loop": {"podtrain.planning.fit", "podtrain.train.run"},
    }
    assert upward_imports(graph) == [
        "podtrain.data.text -> podtrain.models.llama",
        "podtrain.models.llama -> podtrain.program.job",
    ]


def test_schema_loads_nothing_of_podtrain_but_its_parts_the_axes_and_errors():
    code = "import sys, podtrain.config.schema; print(sorted(m for m in sys.modules if m.startswith(PREFIXES)))"
    code = code.replace("PREFIXES", "('podtrain', 'jax', 'flax')")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    config = ["podtrain.config", "podtrain.config.keys", "podtrain.config.parallel", "podtrain.config.schema"]
    assert eval(loaded) == ["podtrain", "podtrain.axes", *config, "podtrain.errors"]  # no jax, no flax


def test_models_and_tasks_know_no_mesh_but_the_sharding_module():
    graph = import_graph()
    for name in graph:
        if name.startswith(("podtrain.models", "podtrain.program.tasks", "podtrain.sharding")):
            wrong = {e for e in graph[name] if e.startswith(("podtrain.runtime", "podtrain.program.load"))}
            assert not wrong, f"{name} imports {wrong}"
