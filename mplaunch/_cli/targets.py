"""What the mplaunch command runs in each rank: a script, a module (-m), or
module:function, resolved and checked here before anything starts."""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback
from typing import List

from .._wire.spec import Script


class UsageError(Exception):
    """The command line names nothing runnable; the message says why."""


def _script_placeholder():  # pragma: no cover - never called: launch runs the script
    raise RuntimeError("mplaunch: a script launch does not call its func")


class EntryPoint:
    """What each rank calls for `package.module:function`: imported by name in the rank
    (so any callable works, picklable or not), with the command line in sys.argv."""

    def __init__(self, module: str, attr: str, argv: List[str]):
        self.module, self.attr, self.argv = module, attr, list(argv)

    def __call__(self):
        sys.argv[:] = self.argv
        result = _resolve(self.module, self.attr)()
        if isinstance(result, int) and not isinstance(result, bool) and result != 0:
            raise SystemExit(result)
        return None


def _resolve(module: str, attr: str):
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _is_function_target(target: str) -> bool:
    module, sep, attr = target.partition(":")
    return (bool(sep) and all(p.isidentifier() for p in module.split("."))
            and all(p.isidentifier() for p in attr.split("."))
            and not os.path.exists(target))


def _sys_path_for(kind: str) -> List[str]:
    """The sys.path the ranks start from, as python would set it for the same target:
    sys.path[0] is where this command was run from (its own script's directory, or the
    current directory for python -m mplaunch), which is no business of the ranks'."""
    path = list(sys.path)
    if getattr(sys.flags, "safe_path", False):
        return path
    path = path[1:]
    if kind != "path":
        path.insert(0, os.getcwd())
    # kind "path": the rank puts the script's directory first itself
    return path


def _check_module(name: str) -> None:
    try:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations is not None:
            if importlib.util.find_spec(name + ".__main__") is None:
                raise UsageError(f"{name!r} is a package with no __main__ module, so it "
                                  "cannot be run with -m")
    except (ImportError, ValueError) as exc:
        raise UsageError(f"cannot run module {name!r}: {type(exc).__name__}: {exc}")
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - importing its package ran user code
        traceback.print_exc()
        raise UsageError(f"cannot run module {name!r}: importing it raised "
                          f"{type(exc).__name__} (traceback above)")
    if spec is None:
        raise UsageError(f"no module named {name!r}")


def _check_function(target: str) -> None:
    module, _, attr = target.partition(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
            raise UsageError(f"cannot run {target!r}: no module named {exc.name!r}")
        traceback.print_exc()
        raise UsageError(f"cannot run {target!r}: importing {module!r} raised "
                          f"{type(exc).__name__} (traceback above)")
    except Exception as exc:  # noqa: BLE001 - import-time code of the user's module
        traceback.print_exc()
        raise UsageError(f"cannot run {target!r}: importing {module!r} raised "
                          f"{type(exc).__name__} (traceback above)")
    obj = mod
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise UsageError(f"cannot run {target!r}: {module!r} has no attribute "
                              f"{attr!r}")
    if not callable(obj):
        raise UsageError(f"cannot run {target!r}: it is a {type(obj).__name__}, not a "
                          "function")


def _check_path(target: str) -> None:
    if not os.path.exists(target):
        raise UsageError(f"can't open file {os.path.abspath(target)!r}: no such file "
                          "(for a function write package.module:function; for a module "
                          "use -m)")
    if os.path.isdir(target) and not any(
            os.path.exists(os.path.join(target, f"__main__.{ext}")) for ext in ("py", "pyc")):
        raise UsageError(f"can't find '__main__' module in {target!r}")


def prepare(ns):
    """(func, Script or None) for what the command line names; raises
    UsageError before anything starts if it names nothing runnable."""
    target, args = ns.target, ns.args
    if ns.module:
        kind = "function" if _is_function_target(target) else "module"
    else:
        kind = "function" if _is_function_target(target) else "path"
    sys.path[:] = _sys_path_for(kind)
    if kind == "function":
        _check_function(target)
        module, _, attr = target.partition(":")
        return EntryPoint(module, attr, [target, *args]), None
    if kind == "module":
        _check_module(target)
    else:
        _check_path(target)
    return _script_placeholder, Script(target, kind, (target, *args))
