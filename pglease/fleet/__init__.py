"""The old name of `pglease.runtime`, kept for one release.

`pglease.fleet` and its public modules (`pglease.fleet.acquire`, `.election`,
`.keeper`, `.lease`) are the very module objects of `pglease.runtime`, so
``isinstance`` checks, monkeypatching and pickles agree across both names.
New code imports `pglease.runtime`.
"""

from __future__ import annotations

import sys

from .. import runtime as _runtime
from ..runtime import *  # noqa: F403  (the alias re-exports every public name)
from ..runtime import __all__ as __all__
from ..runtime import acquire as _acquire_module  # noqa: F401  (loaded for the alias)
from ..runtime import election as _election_module  # noqa: F401
from ..runtime import keeper as _keeper_module  # noqa: F401
from ..runtime import lease as _lease_module  # noqa: F401

# Every loaded submodule of the runtime is reachable under the old dotted name.
for _name, _module in list(sys.modules.items()):
    if _name.startswith(_runtime.__name__ + "."):
        sys.modules[__name__ + _name[len(_runtime.__name__) :]] = _module
