"""The package's layering: no import cycle between kvcomp's packages nor between the modules inside one (every
import statement counts, those inside functions too), every import goes down the layer order, and everything below :mod:`kvcomp.config`
(the codecs, the cache, the kernels, calibration, the benchmarks' base) imports without omegaconf or Hydra.

Above the package sit the repository's ``benchmarks`` (speed and memory benchmarks, profilers) and ``tools`` (the
static performance model, the kernels' compiled resources): they import :mod:`kvcomp`, never the reverse, and each
other as packages (run from the repository root as ``python -m benchmarks.<name>``), never through ``sys.path``;
``kvcomp/`` holds what a model run executes, no module named like a benchmark, a profiler or a static model."""

import ast
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvcomp"
# the top-level packages of the repository, lowest first: a package imports those of its own layer or below
REPOSITORY_LAYERS = [{"kvcomp"}, {"benchmarks", "tools"}]
ABOVE_THE_PACKAGE = [ROOT / name for layer in REPOSITORY_LAYERS[1:] for name in sorted(layer)]
# a benchmark, a profiler or a static model by its module's name (kvcomp.benchmarks, the evaluation a run executes,
# and kvcomp.sweep, a run's sweep, are not)
NOT_RUNTIME = re.compile(r"(^|\.)(bench_\w+|benchmarking|profile_\w+|profil(er|ing)|sweep_decode\w*|static_model|kernel_model"
                         r"|kernel_resources)$|^kvcomp\.kernels\.resources$")

# Lowest first; a unit may import units of its own layer or of layers below it, never above.
LAYERS = [
    {"kvcomp", "kvcomp.errors", "kvcomp.registry", "kvcomp.artifacts", "kvcomp.paths", "kvcomp.schema", "kvcomp.progress",
     "kvcomp.parallel"},
    {"kvcomp.stages"},
    {"kvcomp.kernels"},
    {"kvcomp.codecs"},
    {"kvcomp.presses"},
    {"kvcomp.cache"},
    {"kvcomp.calibration"},
    {"kvcomp.models", "kvcomp.data", "kvcomp.benchmarks", "kvcomp.analysis", "kvcomp.results", "kvcomp.experiments", "kvcomp.plots"},
    {"kvcomp.config"},
    {"kvcomp.runner", "kvcomp.sweep"},
    {"kvcomp.api"},  # the Python API: caches for a loaded model, and runs as the command line makes them
]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit(module: str) -> str:
    """The graph node of a module: ``kvcomp`` itself, a subpackage (``kvcomp.cache``) or a top-level
    module (``kvcomp.config``)."""
    return ".".join(module.split(".")[:2])


def imported_modules(source: str, module: str, is_package: bool) -> set[str]:
    """Every module ``source`` imports, at any depth (functions, methods, ``if`` blocks, ``try``), with
    relative imports resolved; ``from a import b`` counts ``a.b`` when ``b`` is a module of ``a``."""
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names if _is_module(f"{target}.{alias.name}"))
    return found


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def import_graph() -> dict[str, dict[str, list[str]]]:
    """``{unit: {imported unit: [where, ...]}}`` over every module under ``kvcomp/`` (edges to kvcomp
    only, self-edges left out); ``where`` names the importing module."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        edges = graph.setdefault(unit(module), {})
        for target in imported_modules(path.read_text(encoding="utf-8"), module, path.name == "__init__.py"):
            if target == "kvcomp" or target.startswith("kvcomp."):
                if unit(target) != unit(module):
                    edges.setdefault(unit(target), []).append(f"{module} -> {target}")
    return graph


def module_graph() -> dict[str, set[str]]:
    """``{module: {kvcomp module it imports}}`` over every module under ``kvcomp/`` (a package is its
    ``__init__``; self-edges left out)."""
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        found = imported_modules(path.read_text(encoding="utf-8"), module, path.name == "__init__.py")
        graph[module] = {t for t in found if t.startswith("kvcomp") and _is_module(t) and t != module}
    return graph


def find_cycle(graph) -> list[str] | None:
    """One cycle of ``graph`` (``{node: iterable of successors}``) as ``[a, b, ..., a]``, or ``None``."""
    state: dict[str, str] = {}  # "active" while on the depth-first path, then "done"
    path: list[str] = []

    def visit(node):
        state[node] = "active"
        path.append(node)
        for succ in sorted(graph.get(node, ())):
            if state.get(succ) == "active":
                return path[path.index(succ):] + [succ]
            if succ not in state:
                cycle = visit(succ)
                if cycle:
                    return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["a"]}) == ["a", "a"]
    assert find_cycle({"a": ["b", "c"], "b": ["c"], "c": []}) is None


def test_imports_inside_functions_and_relative_imports_are_seen():
    source = textwrap.dedent("""
        import torch
        from kvcomp.stages.codebook import ChunkLayout
        def f():
            from kvcomp.calibration.collect import collect_kv
            if True:
                import kvcomp.config
        from . import base
        from .registry import register
        from kvcomp import cache
    """)
    found = imported_modules(source, "kvcomp.codecs.codebook", is_package=False)
    assert {"kvcomp.stages.codebook", "kvcomp.calibration.collect", "kvcomp.config", "kvcomp.codecs",
            "kvcomp.codecs.base", "kvcomp.codecs.registry", "kvcomp.cache"} <= found
    assert {unit(m) for m in found if m.startswith("kvcomp")} == {
        "kvcomp", "kvcomp.stages", "kvcomp.calibration", "kvcomp.config", "kvcomp.codecs", "kvcomp.cache"}


def test_no_import_cycle_between_packages():
    graph = import_graph()
    assert {"kvcomp.codecs", "kvcomp.cache", "kvcomp.kernels", "kvcomp.stages", "kvcomp.config"} <= set(graph)
    cycle = find_cycle(graph)
    if cycle:
        hops = "\n".join(f"  {a} -> {b}: {', '.join(graph[a][b])}" for a, b in zip(cycle, cycle[1:]))
        raise AssertionError(f"import cycle {' -> '.join(cycle)}:\n{hops}")


def test_no_import_cycle_between_modules():
    """Also inside a package: e.g. a torch reference and its Triton launcher both import the payload
    readers, never each other in both directions; a package's modules never import the package's own
    ``__init__`` when it imports them."""
    graph = module_graph()
    assert {"kvcomp.kernels.formats", "kvcomp.benchmarks.base"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle {' -> '.join(cycle)}"


def test_imports_go_down_the_layers():
    rank = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    graph = import_graph()
    unplaced = sorted(set(graph) - set(rank))
    assert not unplaced, f"place {unplaced} in LAYERS of {__file__}"
    upward = [
        f"{where} (layer {rank[source]} imports layer {rank[target]})"
        for source, edges in graph.items()
        for target, wheres in edges.items()
        if rank[target] > rank[source]
        for where in wheres
    ]
    assert not upward, "imports of a higher layer:\n" + "\n".join(upward)


BLOCKED_IMPORT = """
import sys


class Blocked:
    '''A meta path finder for which omegaconf and hydra are not installed.'''

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("omegaconf", "hydra"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None


sys.meta_path.insert(0, Blocked())
for name in ("omegaconf", "hydra"):
    try:
        __import__(name)
    except ImportError:
        pass
    else:
        raise SystemExit(f"the block does not work: {name} imported")

import kvcomp.cache
import kvcomp.codecs
import kvcomp.kernels
import kvcomp.calibration
import kvcomp.benchmarks

loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("omegaconf", "hydra"))
assert not loaded, loaded
print("imported without omegaconf and hydra")
"""


def test_the_library_below_config_imports_without_omegaconf_and_hydra():
    done = subprocess.run([sys.executable, "-c", BLOCKED_IMPORT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "imported without omegaconf and hydra" in done.stdout


MODEL_STACK = ("transformers.modeling_utils", "transformers.masking_utils")  # seconds to import; loading a model does


def test_the_command_line_is_checked_before_transformers_model_stack_is_imported():
    """What ``run.py`` imports to compose and check a command line (the configs, the sweep and the runner) leaves
    transformers' model stack to the first model, so a refused command line answers in about the time of torch's
    import (measured: 6 s against 12.5 s)."""
    code = "import sys, kvcomp.config, kvcomp.sweep, kvcomp.runner; print(sorted(set(sys.argv[1:]) & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code, *MODEL_STACK], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"


def repository_modules() -> dict[str, Path]:
    """``{module: path}`` of every module of the repository's packages: kvcomp, benchmarks and tools."""
    return {module_name(path): path for directory in (PACKAGE, *ABOVE_THE_PACKAGE) for path in sorted(directory.rglob("*.py"))}


def repository_imports(source: str, module: str, is_package: bool) -> set[str]:
    """The top-level packages of the repository (:data:`REPOSITORY_LAYERS`) that ``source`` imports."""
    packages = set().union(*REPOSITORY_LAYERS)
    return {m.split(".")[0] for m in imported_modules(source, module, is_package)} & packages


def upward_imports() -> list[str]:
    """Every import of a higher top-level package (``kvcomp.kernels.x -> tools``), as ``module -> package``."""
    rank = {name: i for i, layer in enumerate(REPOSITORY_LAYERS) for name in layer}
    found = []
    for module, path in repository_modules().items():
        for target in repository_imports(path.read_text(encoding="utf-8"), module, path.name == "__init__.py"):
            if rank[target] > rank[module.split(".")[0]]:
                found.append(f"{module} -> {target}")
    return found


def edits_sys_path(source: str) -> bool:
    """Whether ``source`` changes ``sys.path`` (an assignment, ``insert``/``append``/``extend``, ``+=``)."""
    def is_sys_path(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) and node.value.id == "sys"

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(is_sys_path(t) or (isinstance(t, ast.Subscript) and is_sys_path(t.value)) for t in targets):
                return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_sys_path(node.func.value):
            if node.func.attr in ("insert", "append", "extend", "remove", "pop", "clear"):
                return True
    return False


def test_the_repository_layer_checks_find_what_they_look_for():
    assert repository_imports("from tools.static_model import count", "kvcomp.kernels.x", False) == {"tools"}
    assert repository_imports("def f():\n    import benchmarks.benchmarking", "kvcomp.cache.x", False) == {"benchmarks"}
    assert repository_imports("from .benchmarks import base\nfrom kvcomp import benchmarks", "kvcomp.x", False) == {"kvcomp"}
    assert edits_sys_path("import sys\nsys.path.insert(0, 'x')") and edits_sys_path("import sys\nsys.path[:0] = ['x']")
    assert edits_sys_path("import sys\nsys.path += ['x']") and not edits_sys_path("import sys\nprint(sys.path)")
    assert all(NOT_RUNTIME.search(name) for name in (
        "kvcomp.kernels.static_model", "kvcomp.kernels.resources", "kvcomp.kernels.benchmarking", "kvcomp.bench_decode_e2e",
        "kvcomp.cache.profile_decode_step", "kvcomp.kernels.sweep_decode_kernel", "kvcomp.kernel_model"))
    assert not any(NOT_RUNTIME.search(name) for name in (
        "kvcomp.benchmarks", "kvcomp.benchmarks.perplexity", "kvcomp.sweep", "kvcomp.kernels.decode_plan", "kvcomp.cache.memory"))


def test_the_package_holds_only_what_a_run_executes():
    """No module of ``kvcomp/`` is a benchmark, a profiler or a static model: those are ``benchmarks/`` and
    ``tools/``."""
    named = sorted(module for module in repository_modules() if module.startswith("kvcomp") and NOT_RUNTIME.search(module))
    assert not named, f"move {named} out of kvcomp/ (to benchmarks/ or tools/)"
    assert (ROOT / "benchmarks" / "benchmarking.py").is_file() and (ROOT / "tools" / "static_model.py").is_file()


def test_benchmarks_and_tools_sit_above_the_package():
    """kvcomp never imports benchmarks or tools (at any depth, inside functions too); they import kvcomp."""
    upward = upward_imports()
    assert not upward, "imports of a higher layer of the repository:\n" + "\n".join(upward)
    modules = repository_modules()
    for package in ("benchmarks", "tools"):
        imported = set().union(*(repository_imports(path.read_text(encoding="utf-8"), module, path.name == "__init__.py")
                                 for module, path in modules.items() if module.startswith(package + ".")))
        assert "kvcomp" in imported, package


def test_benchmarks_and_tools_import_each_other_as_packages():
    """No module of benchmarks/ or tools/ edits ``sys.path`` or imports a sibling file by its bare name (which only
    a ``sys.path`` edit or a run as ``python benchmarks/x.py`` finds); their modules form no import cycle."""
    modules = repository_modules()
    siblings = {path.stem for directory in ABOVE_THE_PACKAGE for path in directory.glob("*.py")} - {"__init__"}
    graph, wrong = {}, []
    for module, path in modules.items():
        if module.split(".")[0] == "kvcomp":
            continue
        source = path.read_text(encoding="utf-8")
        if edits_sys_path(source):
            wrong.append(f"{module} edits sys.path")
        found = imported_modules(source, module, path.name == "__init__.py")
        bare = sorted(m for m in found if m.split(".")[0] in siblings)
        if bare:
            wrong.append(f"{module} imports {bare} by bare name: import them as benchmarks.<name> or tools.<name>")
        graph[module] = {m for m in found if m in modules and m != module and not m.startswith("kvcomp")}
    assert not wrong, "\n".join(wrong)
    assert {"benchmarks.benchmarking", "tools.static_model", "tools.kernel_model"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle {' -> '.join(cycle)}"


def test_only_the_package_is_installed():
    """benchmarks and tools run from the checkout (``python -m``): setuptools' package find includes kvcomp alone."""
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert find["include"] == ["kvcomp*"], find
