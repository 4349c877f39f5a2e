"""`pglease.fleet` is the old name of `pglease.runtime`, kept for one release:
the same module objects under both names."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pglease.fleet
import pglease.runtime


def test_the_alias_exports_every_public_name_of_the_runtime() -> None:
    assert pglease.fleet.__all__ == pglease.runtime.__all__
    for name in pglease.runtime.__all__:
        assert getattr(pglease.fleet, name) is getattr(pglease.runtime, name)


def test_old_dotted_module_names_are_the_runtime_modules() -> None:
    for sub in ("acquire", "election", "keeper", "lease", "_rooms", "_timing"):
        old = importlib.import_module(f"pglease.fleet.{sub}")
        assert old is importlib.import_module(f"pglease.runtime.{sub}"), sub


def test_a_fresh_interpreter_can_import_the_old_name_first() -> None:
    code = (
        "from pglease.fleet.keeper import Keeper\n"
        "import pglease.runtime.keeper as k\n"
        "assert Keeper is k.Keeper\n"
        "print('same')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "same"
