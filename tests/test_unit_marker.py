"""The `unit` marker stays honest: `pytest -m unit` runs the pure tests (no servers, no engine
processes or model loads, no subprocesses) in well under a minute.

Read from the source: a module marked unit (`pytestmark = pytest.mark.unit`) imports no module that
starts processes (subprocess, multiprocessing, fleet_local's processes, servers and stack) and none of
tests/support.py's stack helpers (`embedded_stack` and the rest), itself or through a test helper it
imports, and asks for no fixture that starts a server (conftest's nats-server, SeaweedFS and Redis
fixtures, and those built on them).
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
PYTEST_OPTIONS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
TEST_ROOTS: list[str] = PYTEST_OPTIONS["testpaths"]
SKIPPED_DIRS = {".venv", "build", "__pycache__", "node_modules"}

# Importing any of these (or a module under them) starts processes or servers, or is there to.
SPAWNING_MODULES = (
    "subprocess",
    "multiprocessing",
    "fleet_local.processes",
    "fleet_local.servers",
    "fleet_local.stack",
)
# tests/support.py starts the stack, the CLI and reference generations; only these of its names are pure.
PURE_SUPPORT_NAMES = frozenset({"REPO", "MODEL", "MESSAGES", "SETTING_NAMES", "load_module", "stream_errors"})
SUPPORT = "tests.support"


def _files(pattern: str) -> Iterator[Path]:
    for root in TEST_ROOTS:
        for path in sorted((REPO / root).rglob(pattern)):
            if not SKIPPED_DIRS.intersection(path.relative_to(REPO).parts):
                yield path


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts)


def _imports(path: Path, tree: ast.AST) -> Iterator[tuple[int, str, str]]:
    """(line, module, name) of every import anywhere in `tree`; name "" for `import module`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, ""
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: resolved against the importing file's package
                package = _module_name(path).split(".")[: -node.level]
                module = ".".join([*package, module] if module else package)
            for alias in node.names:
                yield node.lineno, module, alias.name


def _spawning(module: str, name: str) -> bool:
    full = f"{module}.{name}" if name else module
    return any(full == m or full.startswith(m + ".") for m in SPAWNING_MODULES) or (
        module == SUPPORT and name not in PURE_SUPPORT_NAMES
    )


def _is_fixture(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for decorator in function.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if ast.unparse(target) in ("pytest.fixture", "fixture", "pytest_asyncio.fixture"):
            return True
    return False


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    return {a.arg for a in [*function.args.posonlyargs, *function.args.args, *function.args.kwonlyargs]}


def server_fixtures() -> frozenset[str]:
    """Names of the conftest fixtures that start a server (directly, or through another fixture)."""
    needs: dict[str, set[str]] = {}  # fixture -> the fixtures it asks for
    starts: set[str] = set()
    for conftest in [REPO / "conftest.py", *_files("conftest.py")]:
        tree = ast.parse(conftest.read_text())
        spawning_names = {
            name.split(".")[-1] for _, module, name in _imports(conftest, tree) if _spawning(module, name)
        }
        for function in _functions(tree):
            if not _is_fixture(function):
                continue
            needs.setdefault(function.name, set()).update(_parameters(function))
            used = {n.id for stmt in function.body for n in ast.walk(stmt) if isinstance(n, ast.Name)}
            if used & spawning_names:
                starts.add(function.name)
    while True:
        more = {name for name, asked in needs.items() if asked & starts} - starts
        if not more:
            return frozenset(starts)
        starts |= more


def marked_unit(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            return "pytest.mark.unit" in ast.unparse(node.value)
    return False


def violations(path: Path, source: str, servers: frozenset[str], seen: set[Path] | None = None) -> list[str]:
    """What in `source` (the module at `path`) a unit test module must not do."""
    seen = set() if seen is None else seen
    seen.add(path)
    tree = ast.parse(source)
    where = path.relative_to(REPO)
    found = []
    for line, module, name in _imports(path, tree):
        if _spawning(module, name):
            found.append(f"{where}:{line} imports {module}{'.' + name if name else ''}")
        helper = REPO / Path(*module.split(".")).with_suffix(".py")
        if module.split(".")[0] in ("libs", "services", "deploy", "tests") and helper.is_file():
            if helper not in seen and module != SUPPORT:  # a test helper: held to the same rules
                found += violations(helper, helper.read_text(), servers, seen)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "embedded_stack":
            found.append(f"{where}:{node.lineno} uses embedded_stack")
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("mark.usefixtures"):
            for arg in node.args:
                if isinstance(arg, ast.Constant) and arg.value in servers:
                    found.append(f"{where}:{node.lineno} uses the server fixture {arg.value}")
    own = {f.name for f in _functions(tree) if _is_fixture(f)}  # these override the conftest's
    for function in _functions(tree):
        if function.name.startswith("test") or _is_fixture(function):
            for fixture in sorted(_parameters(function) & (servers - own)):
                found.append(
                    f"{where}:{function.lineno} {function.name} asks for the server fixture {fixture}"
                )
    return found


def unit_modules() -> list[Path]:
    return [p for p in _files("test_*.py") if marked_unit(ast.parse(p.read_text()))]


def test_the_server_fixtures_are_found() -> None:
    assert {"nats_server", "s3_server", "redis_server", "fresh_nats", "bucket"} <= server_fixtures()


def test_unit_modules_start_no_processes_and_use_no_servers() -> None:
    modules = unit_modules()
    assert len(modules) > 40, "hardly any module is marked unit: was the marker dropped?"
    servers = server_fixtures()
    found = [v for path in modules for v in violations(path, path.read_text(), servers)]
    assert not found, "modules marked unit must be pure (or lose the marker):\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source",
    [
        "import subprocess\n",
        "from fleet_local.processes import free_port\n",
        "from fleet_local import servers\n",
        "from tests.support import embedded_stack\n",
        "from tests.support import fleet\n",
        "def test_x(fresh_nats):\n    pass\n",
        "import pytest\n\n@pytest.mark.usefixtures('redis_server')\ndef test_x():\n    pass\n",
    ],
)
def test_what_a_unit_module_must_not_do_is_caught(source: str) -> None:
    assert violations(REPO / "tests" / "test_example.py", source, server_fixtures())


def test_a_pure_module_passes() -> None:
    source = "import json\n\nfrom tests.support import REPO\n\ndef test_x(tmp_path):\n    pass\n"
    assert violations(REPO / "tests" / "test_example.py", source, server_fixtures()) == []
    own_store = (
        "import pytest\n\n@pytest.fixture\ndef store():\n    return {}\n\ndef test_x(store):\n    pass\n"
    )
    assert violations(REPO / "tests" / "test_example.py", own_store, server_fixtures()) == []
