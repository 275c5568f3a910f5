"""Run by tests/test_reloads.py in a fresh interpreter: IPython 9's deduperreload (the
default mode of %autoreload 2) patches a module in place, without importlib.reload,
and a World's ranks follow it; prints one RESULT line of JSON."""
import json
import os
import sys
import warnings

from IPython.extensions.deduperreload.deduperreload import DeduperReloader

import mplaunch

sys.path.insert(0, os.getcwd())


def write(name, text):
    with open(name + ".py", "w") as f:
        f.write(text)
    st = os.stat(name + ".py")
    write.tick = max(getattr(write, "tick", 0), st.st_mtime_ns) + 10_000_000
    os.utime(name + ".py", ns=(write.tick, write.tick))


HELPER = """
LIMIT = {limit}

def version():
    return {version!r}

class Model:
    def where(self):
        return {version!r} + ' in a method'
"""
write("dhelper", HELPER.format(limit=1, version="one"))
import dhelper  # noqa: E402
from dhelper import version  # noqa: E402  (a name kept here, as a notebook does)

deduper = DeduperReloader()
deduper.update_sources()   # what IPython does after each cell


def keep():
    """In the ranks: objects made from the module, kept in globals of theirs."""
    global kept_version, kept_model
    kept_version, kept_model = dhelper.version, dhelper.Model()


def read():
    return [dhelper.version(), kept_version(), kept_model.where(), dhelper.LIMIT]


result = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with mplaunch.World(2, start_method=sys.argv[1]) as world:
        world.run(keep)
        result["first"] = world.run(read)
        write("dhelper", HELPER.format(limit=1, version="two"))
        result["patched"] = deduper.maybe_reload_module(dhelper)
        result["spec unchanged"] = dhelper.__spec__ is not None
        result["here"] = [dhelper.version(), version(), dhelper.Model().where()]
        result["ranks"] = world.run(read)
result["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
print("RESULT " + json.dumps(result))
