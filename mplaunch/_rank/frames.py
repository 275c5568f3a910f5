"""Which frames of a rank's traceback are the way mplaunch reached the user's code:
the report of a rank's error (_rank.worker) and its post-mortem (_rank.debugging)
start after them."""
from __future__ import annotations

# mplaunch's own plumbing: an interrupt is never raised in its frames (_rank.call_loop)
__mplaunch_plumbing__ = True


def is_ours(tb) -> bool:
    """A frame of how the rank reached the user's code: mplaunch's own (the worker, a
    front-end's wrapper such as pytest_rank or calls), or runpy's, which ran a script."""
    frame = tb.tb_frame
    name = frame.f_globals.get("__name__")
    name = name if isinstance(name, str) else ""
    return (name == "mplaunch" or name.startswith("mplaunch.") or name == "runpy"
            or frame.f_code.co_filename == "<frozen runpy>")
