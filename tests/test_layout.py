"""The package's structure: its folders are its floors (see
docs/development.md), and the rules below hold between them.

Each rule is a function over the package's import graph or sources that
returns its violations; each is run on the package (none allowed) and on a
small made-up case that breaks it (the check must see it).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest
import workers

import fastspawn
from fastspawn import elastic
from fastspawn._launch.methods import registry
from fastspawn._launch.methods.base import StartMethod

PACKAGE = Path(fastspawn.__file__).parent
METHODS = "fastspawn._launch.methods"

# The floors, lowest first, with what each owns.  A floor imports only the
# floors listed before it (below it); "fastspawn" is the package's own __init__ (the
# lazy public face), "__main__" is ``python -m fastspawn``.
FLOORS = [
    ("_os", "the kernel through the C core: the only importer of _core"),
    ("_wire", "what crosses a process boundary: the report channel, pickling"),
    ("_warden", "the warden process, and the caller's client of it"),
    ("_worker", "what runs inside a worker, from fork or exec to its exit"),
    ("_zygote", "the zygote process: its loop, forking, its protocol and client"),
    ("_launch", "the caller's launch engine: start_processes, contexts, methods/"),
    ("_mp", "fastspawn as a multiprocessing context: contexts, their Popen, the drop-in names"),
    ("elastic", "the public fastspawn.elastic"),
    ("_torch", "torch compatibility: patch_torch, SpawnContext, torch's agent"),
    ("fastspawn", "the lazy public face (fastspawn/__init__.py)"),
    ("_bench", "fastspawn bench"),
    ("_cli", "the command line"),
    ("__main__", "python -m fastspawn"),
]
FLOOR_ORDER = {name: index for index, (name, _owns) in enumerate(FLOORS)}
# The C core: only the kernel's floor imports it.
CORE = "fastspawn._os._core"
# Only the start methods talk to the helper processes' clients.
CLIENTS = {"fastspawn._zygote.client", "fastspawn._warden.client"}
# The public faces, imported (inside the package) only by the command-line floors.
FACES = {"fastspawn", "fastspawn.elastic"}
COMMAND_LINE = {"_bench", "_cli", "__main__"}
MAX_LINES = 700
MAX_TOP_MODULES = 6  # directly in fastspawn/, besides __init__ and __main__


# ------------------------------------------------------------ the graph


def _module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _modules() -> set[str]:
    """Every module of the package: its sources, and the C extension (known
    by its stub, whatever the build's file name)."""
    stubs = {_module_name(path) for path in PACKAGE.rglob("*.pyi")}
    return set(_sources()) | stubs


def _type_checking_only(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Name)
        and (node.test.id == "TYPE_CHECKING")
    )


def _imports(tree: ast.AST, modules: set[str], package: str, type_only: bool = True) -> set[str]:
    """The fastspawn modules a module imports, at any depth (functions too),
    ``if TYPE_CHECKING:`` blocks included unless ``type_only`` is False."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if not type_only and _type_checking_only(node):
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    found.add(f"{base}.{alias.name}")
                elif base in modules:
                    found.add(base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _import_graph() -> dict[str, set[str]]:
    sources = _sources()
    modules = _modules()
    graph = {}
    for name, path in sources.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        graph[name] = _imports(tree, modules, package) - {name}
    return graph


def _floor(module: str) -> str:
    """The floor a module belongs to: its first name below fastspawn."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _find_cycle(graph: Mapping[str, Iterable[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


# ------------------------------------------------------------ the rules


def floor_violations(graph: Mapping[str, Iterable[str]]) -> list[str]:
    """Imports of a floor that is not above the importer's in FLOORS (or
    of a module in no floor at all)."""
    found = []
    for module, targets in sorted(graph.items()):
        mine = _floor(module)
        for target in sorted(targets):
            theirs = _floor(target)
            if theirs == mine:
                continue
            if mine not in FLOOR_ORDER or theirs not in FLOOR_ORDER:
                found.append(f"{module} -> {target}: not in a floor of FLOORS")
            elif FLOOR_ORDER[theirs] > FLOOR_ORDER[mine]:
                found.append(f"{module} ({mine}) imports {target} ({theirs}), a floor above it")
    return found


def floor_cycle(graph: Mapping[str, Iterable[str]]) -> list[str] | None:
    """A cycle between floors (each floor one node), if any."""
    floors: dict[str, set[str]] = {}
    for module, targets in graph.items():
        edges = floors.setdefault(_floor(module), set())
        edges.update(_floor(target) for target in targets if _floor(target) != _floor(module))
    return _find_cycle(floors)


def core_violations(graph: Mapping[str, Iterable[str]]) -> list[str]:
    """Modules outside _os that import the C core."""
    return [
        f"{module} imports {CORE}"
        for module, targets in sorted(graph.items())
        if CORE in targets and _floor(module) != "_os"
    ]


def client_violations(graph: Mapping[str, Iterable[str]]) -> list[str]:
    """Modules outside the start methods that import a helper's client."""
    found = []
    for module, targets in sorted(graph.items()):
        if module.startswith(METHODS + ".") or module in CLIENTS:
            continue
        found += [f"{module} imports {client}" for client in sorted(CLIENTS & set(targets))]
    return found


def face_violations(graph: Mapping[str, Iterable[str]]) -> list[str]:
    """Modules below the command line that import a public face (its
    __init__, not a module inside it)."""
    found = []
    for module, targets in sorted(graph.items()):
        if _floor(module) in COMMAND_LINE or module in FACES:
            continue
        found += [f"{module} imports {face}" for face in sorted(FACES & set(targets))]
    return found


def _module_strings(tree: ast.AST, modules: set[str]) -> list[tuple[int, str]]:
    """String constants that are a fastspawn module's dotted name: how a
    module would find another through ``sys.modules``, importlib or
    logging's registry, where no import check sees it."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in modules and node.value.startswith("fastspawn."):
                found.append((node.lineno, node.value))
    return found


def string_violations(sources: Mapping[str, str], modules: set[str]) -> list[str]:
    """Modules that name another by a string: only the public face's lazy
    table may (test_the_lazy_table_names_real_modules checks it)."""
    found = []
    for module, text in sorted(sources.items()):
        if module == "fastspawn":
            continue
        found += [
            f"{module}:{line}: {value!r}"
            for line, value in _module_strings(ast.parse(text), modules)
        ]
    return found


def _package_sources() -> dict[str, str]:
    return {name: path.read_text() for name, path in _sources().items()}


# ------------------------------------------------- the rules, on the package


def test_the_floors_table_names_every_floor_and_only_those():
    floors = {_floor(module) for module in _sources()}
    assert floors == set(FLOOR_ORDER), floors ^ set(FLOOR_ORDER)


def test_each_floor_imports_only_the_floors_below_it():
    assert floor_violations(_import_graph()) == []


def test_no_cycle_between_floors():
    assert floor_cycle(_import_graph()) is None


def test_no_cycle_between_modules_type_only_imports_included():
    graph = _import_graph()
    assert "fastspawn._launch.methods.base" in graph and graph["fastspawn._launch.methods.registry"]
    cycle = _find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_only_the_kernel_floor_imports_the_c_core():
    graph = _import_graph()
    assert any(CORE in targets for targets in graph.values())  # the walk sees it
    assert core_violations(graph) == []


def test_only_the_start_methods_talk_to_the_helpers_clients():
    assert client_violations(_import_graph()) == []


def test_only_the_command_line_imports_the_public_faces():
    assert face_violations(_import_graph()) == []


def test_no_module_finds_another_by_name():
    assert string_violations(_package_sources(), _modules()) == []


def test_the_lazy_table_names_real_modules():
    # The public face's one table of module names: each resolves, and gives
    # the attribute it is listed for; the rest of __all__ is
    # multiprocessing's, from the drop-in face.
    from fastspawn._mp import face

    for name in fastspawn.__all__:
        assert getattr(fastspawn, name) is not None, name
        module = importlib.import_module(fastspawn._WHERE.get(name, face.__name__))
        assert getattr(module, name) == getattr(fastspawn, name), name  # == : bound methods


def test_the_documented_logger_keeps_its_name():
    # Logging set-ups match the name the docs give; the move kept it.
    from fastspawn._launch import context

    assert context.log.name == "fastspawn._context"
    docs = (PACKAGE.parent / "docs" / "differences.md").read_text()
    assert "`fastspawn._context` logger" in docs


def test_no_module_over_the_line_limit():
    long = {
        name: n
        for name, path in _sources().items()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"over {MAX_LINES} lines (split along the seam): {long}"


def test_few_modules_directly_in_the_package():
    top = [
        path.name
        for path in PACKAGE.glob("*.py")
        if path.name not in ("__init__.py", "__main__.py")
    ]
    assert len(top) <= MAX_TOP_MODULES, top


def test_every_floor_says_what_it_owns():
    for floor, _owns in FLOORS:
        init = PACKAGE / floor / "__init__.py"
        if floor in ("fastspawn", "__main__"):
            continue
        assert ast.get_docstring(ast.parse(init.read_text())), f"{init} has no docstring"


def test_the_development_map_lists_every_floor():
    text = (PACKAGE.parent / "docs" / "development.md").read_text()
    for floor, _owns in FLOORS:
        if floor not in ("fastspawn", "__main__"):
            assert f"`{floor}/`" in text, floor


# ------------------------------------------- the rules, on made-up breaches


def test_the_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_import_walk_sees_imports_inside_functions_and_type_only_ones():
    code = (
        "TYPE_CHECKING = False\n"
        "if TYPE_CHECKING:\n    from fastspawn._wire import channel\n"
        "def f():\n    from fastspawn._os import oscall\n"
    )
    modules = {"fastspawn._os.oscall", "fastspawn._wire.channel"}
    tree = ast.parse(code)
    assert _imports(tree, modules, "fastspawn") == modules
    assert _imports(tree, modules, "fastspawn", type_only=False) == {"fastspawn._os.oscall"}


def test_a_floor_importing_one_above_it_is_caught():
    graph = {"fastspawn._os.oscall": {"fastspawn._launch.api"}, "fastspawn._launch.api": set()}
    assert floor_violations(graph) == [
        "fastspawn._os.oscall (_os) imports fastspawn._launch.api (_launch), a floor above it"
    ]
    assert floor_violations({"fastspawn._attic.old": {"fastspawn._os.oscall"}})


def test_a_cycle_between_floors_is_caught():
    graph = {
        "fastspawn._worker.runner": {"fastspawn._zygote.server"},
        "fastspawn._zygote.server": {"fastspawn._worker.forked"},
        "fastspawn._worker.forked": set(),
    }
    assert _find_cycle(graph) is None  # no cycle between the modules...
    assert floor_cycle(graph) == ["_worker", "_zygote", "_worker"]  # ... but between floors


def test_a_type_only_cycle_is_caught():
    modules = {"fastspawn._launch.a", "fastspawn._launch.b"}
    a = "from fastspawn._launch import b\n"
    b = "TYPE_CHECKING = False\nif TYPE_CHECKING:\n    from fastspawn._launch import a\n"
    graph = {
        "fastspawn._launch.a": _imports(ast.parse(a), modules, "fastspawn._launch"),
        "fastspawn._launch.b": _imports(ast.parse(b), modules, "fastspawn._launch"),
    }
    assert _find_cycle(graph) == [
        "fastspawn._launch.a",
        "fastspawn._launch.b",
        "fastspawn._launch.a",
    ]


def test_the_core_imported_above_the_kernel_is_caught():
    graph = {"fastspawn._worker.stacks": {CORE}, "fastspawn._os.oscall": {CORE}}
    assert core_violations(graph) == [f"fastspawn._worker.stacks imports {CORE}"]


def test_a_client_imported_outside_the_methods_is_caught():
    graph = {
        "fastspawn._cli.main": {"fastspawn._zygote.client"},
        "fastspawn._launch.methods.zygote": {"fastspawn._zygote.client"},
    }
    assert client_violations(graph) == ["fastspawn._cli.main imports fastspawn._zygote.client"]


def test_a_face_imported_below_the_command_line_is_caught():
    graph = {
        "fastspawn._torch.agent": {"fastspawn.elastic", "fastspawn.elastic.start"},
        "fastspawn._cli.restart": {"fastspawn.elastic", "fastspawn"},
    }
    assert face_violations(graph) == ["fastspawn._torch.agent imports fastspawn.elastic"]


def test_a_module_found_by_name_is_caught():
    modules = {"fastspawn._launch.context", "fastspawn._worker.runner"}
    sources = {
        "fastspawn._worker.runner": (
            'import sys\nctx = sys.modules.get("fastspawn._launch.context")\n'
        ),
        "fastspawn": '_WHERE = {"x": "fastspawn._launch.context"}\n',
    }
    assert string_violations(sources, modules) == [
        "fastspawn._worker.runner:2: 'fastspawn._launch.context'"
    ]


# ------------------------------------------------------ the start methods


def _public_names_in_init(tree: ast.Module) -> set[int]:
    """ids of the string constants in __init__.py that name public
    attributes (the function ``spawn``), not start methods: __all__'s
    items and the keys of the lazy-import table."""
    allowed: set[int] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, (ast.List, ast.Dict)):
            target = node.targets[0]
            if isinstance(target, ast.Name) and target.id in ("__all__", "_WHERE"):
                items = node.value.elts if isinstance(node.value, ast.List) else node.value.keys
                allowed.update(id(item) for item in items if item is not None)
    return allowed


def test_method_names_are_spelled_only_in_the_methods_package():
    names = set(registry.names())
    assert {"zygote", "spawn", "fork", "forkserver"} <= names
    found = []
    for name, path in _sources().items():
        if name == METHODS or name.startswith(METHODS + "."):
            continue
        tree = ast.parse(path.read_text())
        allowed = (
            _public_names_in_init(tree)
            if path.name == "__init__.py" and (path.parent == PACKAGE)
            else set()
        )
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in allowed:
                found.append(f"{name}:{node.lineno}: {node.value!r}")
    assert not found, f"start-method names outside {METHODS}:\n" + "\n".join(found)


def test_a_start_method_from_one_file_runs_a_launch():
    import toy_method  # registers "toy"

    try:
        assert "toy" in registry.names()
        ctx = fastspawn.start_processes(workers.pid_and_ppid, nprocs=3, start_method="toy")
        assert sorted(ctx.return_values) == [0, 1, 2]
        assert {ppid for _pid, ppid in ctx.return_values.values()} == {os.getpid()}
        with pytest.raises(fastspawn.ProcessRaisedException, match="legitimate exception"):
            fastspawn.start_processes(workers.raise_on, (1, 0.0), nprocs=2, start_method="toy")
        with pytest.raises(ValueError, match="preload applies to start_method 'zygote'"):
            fastspawn.start_processes(
                workers.succeed, nprocs=1, start_method="toy", preload=["json"]
            )
    finally:
        registry.unregister(toy_method.METHOD.name)
    with pytest.raises(ValueError, match="unknown start_method 'toy'"):
        fastspawn.start_processes(workers.succeed, nprocs=1, start_method="toy")


def test_registering_a_taken_or_empty_name_is_refused():
    with pytest.raises(ValueError, match="registered already"):
        registry.register(registry.get("fork"))
    with pytest.raises(ValueError, match="needs a name"):
        registry.register(StartMethod())


def test_elastic_unknown_start_method_lists_the_valid_ones(tmp_path):
    with pytest.raises(ValueError) as raised:
        elastic.start_processes(
            "trainer", workers.succeed, {0: (0,)}, {0: {}}, str(tmp_path), start_method="bogus"
        )
    message = str(raised.value)
    assert "'bogus'" in message
    for name in registry.names():
        assert repr(name) in message
    assert list(tmp_path.iterdir()) == []  # refused before any log file was made


@pytest.mark.skipif(
    importlib.util.find_spec("ruff") is None and shutil.which("ruff") is None,
    reason="ruff is not installed (it is in the test extra)",
)
def test_ruff_with_the_complexity_limit_is_clean():
    root = PACKAGE.parent
    config = (root / "pyproject.toml").read_text()
    assert '"C90"' in config and "max-complexity = 12" in config
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "fastspawn"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_typed_names_are_the_built_in_methods():
    import typing

    assert set(typing.get_args(registry.StartMethodName)) == set(registry.names())
    assert registry.get(registry.DEFAULT).name == registry.DEFAULT
