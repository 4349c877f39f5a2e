"""The import graph of the package has no upward arrow.

Layers, lowest first: the core (types, errors, validation, ids, cursors,
payloads, clock, durations, sans-I/O helpers), the drivers (postgres, sqlite,
migrations, roles), the runtime (runtime, its alias fleet, watch), sessions, and the applications
(the CLI modules, the demo, doctor, the embedded server's CLI). A module may
import its own layer or lower ones. The known upward arrows are listed below
with their reason; the test fails when a new one appears and when a listed one
is gone (so the list only shrinks, as the redesign removes them).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pglease"

CORE, DRIVER, RUNTIME, SESSIONS, APP = range(5)

_LAYER_OF_TOP = {
    "postgres": DRIVER, "sqlite": DRIVER, "migrations": DRIVER, "_migrate": DRIVER,
    "_migrate_async": DRIVER, "roles": DRIVER, "admin": DRIVER, "testing": DRIVER,
    "dsn": DRIVER, "embedded": DRIVER, "listing": DRIVER, "cursor_check": DRIVER,
    "_migration_core": DRIVER,
    "runtime": RUNTIME, "fleet": RUNTIME, "watch": RUNTIME,
    "sessions": SESSIONS,
    "cli": APP, "demo": APP, "doctor": APP,
    "__main__": APP,
    # Backend-free, so in the core (every other top-level name is too): the one
    # lease store and the driver protocols it and the runtime call.
    "store": CORE, "driver": CORE,
}  # fmt: skip

#: (importer, imported): why it is still there. Empty: every arrow points down.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return APP  # the package's __init__: the public facade re-exports every layer
    return _LAYER_OF_TOP.get(parts[1], CORE)


_TYPE_CHECKING = {"TYPE_CHECKING", "typing.TYPE_CHECKING"}


def imports() -> set[tuple[str, str]]:
    edges: set[tuple[str, str]] = set()
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        # Imports under `if TYPE_CHECKING:` name types in annotations and load
        # nothing: a store may name the runtime's HeldLease as a return type.
        typing_only = {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and ast.unparse(node.test) in _TYPE_CHECKING
            for stmt in node.body
            for inner in ast.walk(stmt)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                # `from .. import cursor_check` imports the module pglease.cursor_check.
                targets = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            edges.update(
                (module, t) for t in targets if t.split(".")[0] == "pglease" and t != module
            )
    return edges


def test_no_upward_import_but_the_listed_ones() -> None:
    upward = {(a, b) for a, b in imports() if layer(b) > layer(a)}
    assert upward - KNOWN_UPWARD.keys() == set(), "new upward imports"
    assert KNOWN_UPWARD.keys() - upward == set(), "fixed: remove them from KNOWN_UPWARD"


def test_nothing_in_the_library_imports_an_application() -> None:
    offenders = {(a, b) for a, b in imports() if layer(b) == APP and layer(a) != APP}
    offenders |= {(a, b) for a, b in imports() if b == "pglease" and a.count(".") > 0}
    assert offenders == set()


def test_the_core_imports_no_driver() -> None:
    # The core is what every driver and the runtime share: psycopg-free.
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        if "." in module and layer(module) == CORE:
            text = path.read_text()
            assert "import psycopg" not in text and "from psycopg" not in text, module


#: The backend libraries and packages the runtime (`runtime/`, `fleet/`, `watch/`) may not
#: import: it reaches a backend only through the driver protocols.
_BACKENDS = ("psycopg", "psycopg_pool", "sqlite3", "pglease.postgres", "pglease.sqlite")
_RUNTIME_PACKAGES = ("pglease.runtime", "pglease.fleet", "pglease.watch")

#: Runtime modules that still import a backend, with why. The test fails when
#: a new one appears and when a listed one no longer does (the list only shrinks).
PENDING_BACKEND_IMPORTS: dict[str, str] = {}


def _backend_imports(path: Path) -> set[str]:
    """The backend modules `path` imports (typing-only imports included: a
    runtime module should not even name a driver's types)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                names = [".".join(base + ([node.module] if node.module else []))]
            else:
                names = [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found.update(n for n in names for b in _BACKENDS if n == b or n.startswith(b + "."))
    return found


def test_the_runtime_imports_no_backend() -> None:
    offenders: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        if module.startswith(_RUNTIME_PACKAGES) and (found := _backend_imports(path)):
            offenders[module] = found
    assert offenders.keys() - PENDING_BACKEND_IMPORTS.keys() == set(), offenders
    assert PENDING_BACKEND_IMPORTS.keys() - offenders.keys() == set(), "fixed: unlist them"
