"""Which modules the calling process reloaded since a World's ranks last ran: the ranks
reload the same ones before the next call (_rank.reloads), so that a helper module that
was edited and reloaded here (``importlib.reload``, IPython's ``%autoreload``) runs as
edited in the ranks too, instead of the version they imported first.

The sign is the module's ``__spec__``: a reload runs the module again in its own module
object and gives it a new spec, and so does an import after ``del sys.modules[name]``.
Reading it for every module of ``sys.modules`` at each run costs well under a
millisecond, with no import hook to install and no file to stat.

Rejected: reloading in the ranks every module whose file changed on disk (what
``%autoreload`` does in one process). The ranks would then run code the calling process
does not, and a World would stat every imported file at each call. A module edited but
not reloaded here stays as the ranks imported it, as it stays here.
"""
from __future__ import annotations

import sys
import types
from typing import Dict, List, Optional

__all__ = ["ModuleWatch"]

# Never reloaded in the ranks: the caller's __main__ travels with each call anyway
# (_wire.mainmod), and mplaunch's own modules run the ranks.
_SKIP = ("__main__", "__mp_main__")


class ModuleWatch:
    """The specs of this process's source modules at the last look."""

    def __init__(self):
        self._seen: Optional[Dict[str, object]] = None

    def reloaded(self) -> List[str]:
        """The modules reloaded since the last call (none at the first), in the order
        this process first imported them."""
        now = _source_specs()
        before, self._seen = self._seen, now
        if before is None:
            return []
        return [name for name, spec in now.items()
                if name in before and before[name] is not spec]


def _source_specs() -> Dict[str, object]:
    specs = {}
    for name, module in list(sys.modules.items()):
        if not isinstance(module, types.ModuleType) or name in _SKIP \
                or name == "mplaunch" or name.startswith("mplaunch."):
            continue
        # The module's own dict: no module __getattr__ (lazy modules) runs.
        spec = module.__dict__.get("__spec__")
        origin = getattr(spec, "origin", None)
        if isinstance(origin, str) and origin.endswith(".py"):
            specs[name] = spec
    return specs
