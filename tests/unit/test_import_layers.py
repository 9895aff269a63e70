"""The shape of the code, read from its imports with ``ast`` (nothing is imported):

- no import circle among engine/ modules (function-level imports included; imports under
  ``if TYPE_CHECKING:`` are annotations only and run never, so they close no circle);
- no upward arrow: each engine module sits on a layer and imports only from its own
  layer or below (so the KV cache never imports the scheduler, the engine never imports
  the server), and the server sits above the whole engine;
- collaborators are passed to constructors: the build functions assign no attribute of
  another object, and no control-plane object reaches into a collaborator to set one.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Lower layers never import higher ones. A new engine module gets a line here.
ENGINE_LAYERS: dict[str, int] = {
    "engine.config": 0,
    "engine.platform": 0,
    "engine.dtypes": 0,
    "engine.host_alloc": 0,
    "engine.host_memory": 0,
    "engine.grammar_spec": 0,
    "engine.detokenizer": 0,
    "engine.model_files": 0,
    "engine.hf_config": 0,  # reads a model's config.json (transformers' base class only)
    "engine.heap": 0,
    "engine.child_process": 0,
    "engine.errors": 0,
    "engine.cache_salt": 0,
    "engine.request": 1,
    "engine.kvcache.miss_reasons": 1,  # plain counts a request carries
    "engine.cache_trace": 0,
    "engine.kvcache": 2,
    "engine.outputs": 2,
    "engine.output_streams": 2,
    "engine.output_wire": 2,
    "engine.request_checks": 2,
    "engine.grammar_pool": 1,
    "engine.grammar_worker": 1,  # the compile worker process (loads xgrammar without torch)
    "engine.grammar_matcher": 1,
    "engine.grammar": 2,
    "engine.layers": 3,
    "engine.group_turns": 2,
    "engine.client_share": 2,
    "engine.prefill_sharing": 2,
    "engine.scheduled_batch": 2,
    "engine.step_budget": 0,
    "engine.output_reserve": 0,
    "engine.scheduler": 3,
    "engine.kv_setup": 3,
    "engine.models": 4,
    "engine.gguf_convert": 4,  # uses the packed kernel's type table (engine.layers)
    "engine.gguf_layout": 4,  # reads a converted directory (engine.models' GGUF table)
    "engine.penalties": 2,
    "engine.sampler": 4,
    "engine.future_tokens": 4,
    "engine.sampler_output": 4,
    "engine.graph_runner": 4,
    "engine.graph_setup": 4,
    "engine.graph_startup": 4,
    "engine.graph_buckets": 4,
    "engine.mixed_graphs": 4,
    "engine.prompt_scoring": 4,
    "engine.loader": 5,
    "engine.model_runner": 5,
    "engine.tp": 6,
    "engine.engine_stats": 6,
    "engine.build": 7,
    "engine.step_loop": 7,
    "engine.engine": 8,
    "engine.engine_core": 9,
    "engine.engine_process": 9,
    "engine.async_engine": 10,
    "engine": 11,  # the package's own __init__ re-exports the public names
}
# Modules that build and wire collaborators: they set attributes only on ``self``.
WIRING_MODULES = (
    "engine/build.py",
    "engine/kv_setup.py",
    "engine/kvcache/hicache_setup.py",
    "engine/tp/runtime.py",
)


def module_files(package: str) -> dict[str, Path]:
    files = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        files[name] = path
    return files


def _type_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                found.update(id(n) for n in ast.walk(child))
    return found


def imported_names(source: str, runtime_only: bool = False) -> Iterator[str]:
    """Every absolute name ``source`` imports, at any depth of the file (``from a import b``
    gives ``a.b``: the module ``a.b``, or the name ``b`` of module ``a``); with
    ``runtime_only``, not the imports under ``if TYPE_CHECKING:``."""
    tree = ast.parse(source)
    skip = _type_only(tree) if runtime_only else set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def import_graph(modules: dict[str, Path], runtime_only: bool = False) -> dict[str, set[str]]:
    """module -> the modules of ``modules`` it imports."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in imported_names(path.read_text(), runtime_only):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def layer_of(module: str) -> int | None:
    """The layer of ``module`` or of the package it is in (the bare ``engine`` entry is the
    package's own __init__ only, not a default for every module)."""
    if module == "engine":
        return ENGINE_LAYERS["engine"]
    while "." in module:
        if module in ENGINE_LAYERS:
            return ENGINE_LAYERS[module]
        module = module.rpartition(".")[0]
    return None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for source, targets in graph.items():
        for target in targets:
            low, high = layer_of(source), layer_of(target)
            if low is not None and high is not None and high > low:
                wrong.append(f"{source} (layer {low}) imports {target} (layer {high})")
    return sorted(wrong)


def foreign_assignments(source: str, self_only: bool) -> list[str]:
    """Attribute assignments that set a collaborator's attribute: ``self.a.b = ...``, or
    with ``self_only`` any target other than ``self.<name>`` (``runner.on_step = ...``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        else:
            continue
        flat = [
            t
            for target in targets
            for t in (target.elts if isinstance(target, ast.Tuple) else [target])
        ]
        for target in flat:
            if not isinstance(target, ast.Attribute):
                continue
            on_self = isinstance(target.value, ast.Name) and target.value.id == "self"
            through_self = (
                isinstance(target.value, ast.Attribute)
                and isinstance(target.value.value, ast.Name)
                and target.value.value.id == "self"
            )
            if through_self or (self_only and not on_self):
                found.append(f"line {node.lineno}: {ast.unparse(target)} = ...")
    return found


# ---------------------------------------------------------------- the checks themselves


def test_checkers_see_what_they_look_for() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert layer_of("engine.not_placed_yet") is None
    assert upward_imports({"engine.kvcache.manager": {"engine.scheduler"}}) == [
        "engine.kvcache.manager (layer 2) imports engine.scheduler (layer 3)"
    ]
    assert foreign_assignments("self.runner.graphs = g\nself.x = 1\n", self_only=False) == [
        "line 1: self.runner.graphs = ..."
    ]
    wiring = "def attach(kv, runner):\n    kv.req_table.journal = []\n    runner.on_step = f\n"
    assert len(foreign_assignments(wiring, self_only=True)) == 2
    assert list(imported_names("def f():\n    from engine.tp import worker\n")) == [
        "engine.tp.worker"
    ]
    typed = "if TYPE_CHECKING:\n    from engine.a import B\nimport engine.c\n"
    assert list(imported_names(typed, runtime_only=True)) == ["engine.c"]
    assert sorted(imported_names(typed)) == ["engine.a.B", "engine.c"]


def test_no_import_cycle_in_engine() -> None:
    assert find_cycle(import_graph(module_files("engine"), runtime_only=True)) is None


def test_every_engine_module_has_a_layer() -> None:
    missing = [name for name in module_files("engine") if layer_of(name) is None]
    assert not missing, f"add these to ENGINE_LAYERS: {missing}"


def test_no_upward_import_in_engine() -> None:
    assert upward_imports(import_graph(module_files("engine"))) == []


@pytest.mark.parametrize("package", ["engine"])
def test_engine_never_imports_server_bench_or_tests(package: str) -> None:
    above = ("server", "bench", "tests", "docker")
    wrong = [
        f"{name} imports {imported}"
        for name, path in module_files(package).items()
        for imported in imported_names(path.read_text())
        if imported.split(".")[0] in above
    ]
    assert wrong == []


def test_server_imports_no_bench_or_tests() -> None:
    wrong = [
        f"{name} imports {imported}"
        for name, path in module_files("server").items()
        for imported in imported_names(path.read_text())
        if imported.split(".")[0] in ("bench", "tests")
    ]
    assert wrong == []


@pytest.mark.parametrize("relative", WIRING_MODULES)
def test_build_functions_pass_collaborators_to_constructors(relative: str) -> None:
    assert foreign_assignments((ROOT / relative).read_text(), self_only=True) == []


def test_control_plane_sets_no_collaborator_attribute() -> None:
    files = [*(ROOT / "engine").glob("*.py"), *(ROOT / "engine" / "tp").glob("*.py")]
    wrong = {
        str(path.relative_to(ROOT)): found
        for path in files
        if (found := foreign_assignments(path.read_text(), self_only=False))
    }
    assert wrong == {}
