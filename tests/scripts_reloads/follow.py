"""Run by tests/test_reloads.py in a fresh interpreter (its own __main__ and
sys.modules): a World's ranks follow the modules this script changes, in each way it
changes them; prints one RESULT line of JSON. argv[1]: the start method."""
import importlib
import json
import os
import sys
import time
import warnings

import mplaunch

sys.path.insert(0, os.getcwd())


def write(name, text):
    # A new (mtime, size) each time, as an editor's save gives, also within one tick
    # of a coarse clock.
    with open(name + ".py", "w") as f:
        f.write(text)
    st = os.stat(name + ".py")
    write.tick = max(getattr(write, "tick", 0), st.st_mtime_ns) + 10_000_000
    os.utime(name + ".py", ns=(write.tick, write.tick))


write("early", "def version():\n    return 'early one'\n")
write("syntax", "def version():\n    return 'syntax one'\n")
write("onerank", "def a():\n    return 'a one'\n\ndef b():\n    return 'b one'\n")
write("anew", "def version():\n    return 'anew one'\n")
import anew, early, onerank, syntax  # noqa: E401,E402


def versions():
    return [early.version(), syntax.version(), onerank.a(), onerank.b(),
            anew.version()]


result = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with mplaunch.World(3, start_method=sys.argv[1]) as world:
        world.start()
        # Reloaded between start() and the first run.
        write("early", "def version():\n    return 'early two'\n")
        importlib.reload(early)
        result["first"] = world.run(versions)
        # A reload that fails here (SyntaxError), then the file fixed but not
        # reloaded: this process runs 'syntax one', and so must the ranks.
        write("syntax", "def version(:\n")
        try:
            importlib.reload(syntax)
        except SyntaxError:
            pass
        write("syntax", "def version():\n    return 'syntax three, not run here'\n")
        result["syntax"] = world.run(versions)
        # A reload that fails in rank 1 only, half-way through the module.
        write("onerank", "import os\n\ndef a():\n    return 'a two'\n\n"
                         "if os.environ.get('RANK') == '1':\n"
                         "    raise RuntimeError('only on rank 1')\n\n"
                         "def b():\n    return 'b two'\n")
        importlib.reload(onerank)
        result["onerank"] = world.run(versions)
        result["onerank warnings"] = [str(w.message) for w in caught]
        del caught[:]
        # Imported anew after del sys.modules.
        write("anew", "def version():\n    return 'anew two'\n")
        del sys.modules["anew"]
        import anew  # noqa: F811,E402
        result["anew"] = world.run(versions)
        result["here"] = versions()
        result["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
        del caught[:]
        # A function new in a module that rank 1 cannot reload: rank 1 cannot load the
        # call (the function goes by reference), and the warning still says why.
        onerank_c = ("import os\n\ndef a():\n    return 'a three'\n\n"
                     "def c():\n    return 'c three'\n\n"
                     "if os.environ.get('RANK') == '1':\n"
                     "    raise RuntimeError('only on rank 1, again')\n")
        write("onerank", onerank_c)
        importlib.reload(onerank)
        try:
            world.run(onerank.c)
        except mplaunch.WorkerError as err:
            result["new function"] = [err.rank, str(err.exc_type).rpartition(".")[2]]
        result["new function warnings"] = [str(w.message) for w in caught]
        del caught[:]
        # Warnings as errors: the call's error is still the one raised, the warning
        # its context (the failed call's reloads went down again with this call).
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            try:
                world.run(onerank.c)
            except mplaunch.WorkerError as err:
                result["as errors"] = [err.rank, type(err.__context__).__name__]
print("RESULT " + json.dumps(result))
