"""A rank that runs a script as `__main__` (the mplaunch command): the processes it starts
with spawn or forkserver (DataLoader workers, a Pool) rebuild `__main__` from what the
script has defined, by value, instead of running the script again (see _wire.mainmod for
the layout they read)."""
from __future__ import annotations

import os
import sys
import types

from .._wire import mainmod, payload


def guard_script_children() -> None:
    """In a rank about to run a script as `__main__`: its spawn and forkserver children
    rebuild `__main__` from what the script has defined when they start, and never run
    the script (see the module's docstring)."""
    import multiprocessing.spawn as mp_spawn
    original = mp_spawn.get_preparation_data
    if getattr(original, "_mplaunch", False):
        return
    fd = os.memfd_create("mplaunch-main", os.MFD_CLOEXEC)  # open for the rank's life
    os.environ[mainmod.ENV] = mainmod.publish(fd)

    def get_preparation_data(name):
        data = original(name)
        if "init_main_from_path" in data or "init_main_from_name" in data:
            data.pop("init_main_from_path", None)
            data["init_main_from_name"] = mainmod.CHILD_MAIN
            _write_script_main(fd)
        return data

    get_preparation_data._mplaunch = True
    mp_spawn.get_preparation_data = get_preparation_data


def _write_script_main(fd: int) -> None:
    """The classes and functions the running script's `__main__` has defined, by value,
    in the layout fill_child_main reads (a pickle, then its offset: 0)."""
    main = sys.modules["__main__"]
    defined = {k: v for k, v in vars(main).items()
               if isinstance(v, (type, types.FunctionType))
               and getattr(v, "__module__", None) in mainmod.MAIN_NAMES}
    try:
        data = payload.dumps_main_part(main, defined)
    except Exception:  # noqa: BLE001 - send what pickles; say what does not
        ok = {}
        for key, value in defined.items():
            try:
                payload.dumps_main_part(main, {key: value})
                ok[key] = value
            except Exception as exc:  # noqa: BLE001
                sys.stderr.write(
                    f"[mplaunch] {key!r}, defined in the script, cannot be sent to the "
                    f"processes this rank starts with spawn or forkserver ({exc}); they "
                    f"rebuild __main__ from the rank instead of running the script again, "
                    f"and will not find it there. Define it in a module the script "
                    f"imports.\n")
        data = payload.dumps_main_part(main, ok)
    os.ftruncate(fd, 0)
    view = memoryview(data + (0).to_bytes(8, "little"))
    offset = 0
    while offset < len(view):
        offset += os.pwrite(fd, view[offset:], offset)
