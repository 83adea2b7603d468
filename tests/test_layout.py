"""The package's structure: no import cycles, start methods named only in
fastspawn/_methods/, a start method pluggable from one file, the
complexity limit kept."""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import workers

import fastspawn
from fastspawn import elastic
from fastspawn._methods import registry
from fastspawn._methods.base import StartMethod

PACKAGE = Path(fastspawn.__file__).parent
METHODS_DIR = PACKAGE / "_methods"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _type_checking_only(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Name)
        and (node.test.id == "TYPE_CHECKING")
    )


def _imports(tree: ast.AST, modules: set[str], package: str) -> set[str]:
    """The fastspawn modules a module imports, at any depth (functions
    too), leaving out ``if TYPE_CHECKING:`` blocks (type names only)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _type_checking_only(node):
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
    modules = set(sources)
    graph = {}
    for name, path in sources.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        graph[name] = _imports(ast.parse(path.read_text()), modules, package) - {name}
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
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


def test_the_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_import_walk_sees_imports_inside_functions():
    tree = ast.parse("def f():\n    from fastspawn import _oscall\n")
    assert _imports(tree, {"fastspawn._oscall"}, "fastspawn") == {"fastspawn._oscall"}


def test_no_import_cycles():
    graph = _import_graph()
    assert "fastspawn._launch" in graph and graph["fastspawn._methods.registry"]
    assert _find_cycle(graph) is None, " -> ".join(_find_cycle(graph) or [])


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
        if METHODS_DIR in path.parents:
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
    assert not found, "start-method names outside fastspawn/_methods/:\n" + "\n".join(found)


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
