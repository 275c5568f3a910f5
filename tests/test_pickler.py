"""Code that mplaunch ships keeps its file name and lines under every cloudpickle that
setup.cfg admits (3.1.3 writes "<dynamic-code>" into every code object it pickles by value),
and cloudpickle's own behaviour in the same process is left as its release makes it.

Nothing here depends on what the installed cloudpickle writes: the checks compare with
the file each function was compiled from.
"""
from __future__ import annotations

import dis
import pickle
import subprocess
import sys
import textwrap
import types

import cloudpickle
import pytest

from mplaunch._wire import pickler
from mplaunch._wire.payload import dumps_payload

pytestmark = pytest.mark.no_torch

SOURCE = textwrap.dedent("""
    def outer(x):
        def inner(y):
            return [z for z in range(y) if z > 1]
        helper = lambda: inner(x)
        return helper()

    class Thing:
        def method(self):
            raise ValueError("in a method")
""")


def _defined_in(filename: str) -> dict:
    """A namespace as a script or notebook cell makes it: not importable, so cloudpickle
    pickles its functions by value."""
    namespace = {"__name__": "not_importable_here"}
    exec(compile(SOURCE, filename, "exec"), namespace)
    return namespace


def _all_code(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _all_code(const)


def test_functions_and_their_nested_code_keep_their_file_and_lines():
    ns = _defined_in("/home/someone/train.py")
    loaded = pickle.loads(pickler.dumps((ns["outer"], ns["Thing"])))
    outer, thing = loaded
    assert outer(4) == [2, 3]
    for original, copy in ((ns["outer"], outer), (ns["Thing"].method, thing.method)):
        pairs = list(zip(_all_code(original.__code__), _all_code(copy.__code__)))
        assert len(pairs) > 0
        for a, b in pairs:
            assert (b.co_filename, b.co_firstlineno, b.co_name) == \
                ("/home/someone/train.py", a.co_firstlineno, a.co_name)
            assert list(dis.findlinestarts(b)) == list(dis.findlinestarts(a))


def test_a_traceback_in_a_loaded_function_names_the_file_and_line():
    ns = _defined_in("<ipython-input-7-abc>")
    thing = pickle.loads(pickler.dumps(ns["Thing"]))()
    with pytest.raises(ValueError) as info:
        thing.method()
    frame = info.traceback[-1]
    assert str(frame.path) == "<ipython-input-7-abc>"
    raising = SOURCE.splitlines().index('        raise ValueError("in a method")') + 1
    assert frame.lineno + 1 == raising   # pytest's lineno counts from 0


def test_the_payload_a_rank_loads_keeps_the_file_of_main_functions(tmp_path):
    """The real route: a script's __main__ function through dumps_payload, loaded in a
    fresh interpreter as a rank loads it."""
    script = tmp_path / "user_script.py"
    script.write_text(textwrap.dedent("""
        import sys
        from mplaunch._wire.payload import dumps_payload
        def work():
            return [c for c in "ab"]
        sys.stdout.buffer.write(dumps_payload(work, (), {}))
    """))
    payload = subprocess.run([sys.executable, str(script)], check=True,
                             capture_output=True).stdout
    probe = textwrap.dedent("""
        import sys, tempfile
        from mplaunch._wire.payload import loads_payload
        data = sys.stdin.buffer.read()
        with tempfile.NamedTemporaryFile() as f:
            func, args, kwargs = loads_payload(data, f.name)
        codes = [func.__code__] + [c for c in func.__code__.co_consts if hasattr(c, "co_filename")]
        print("\\n".join(c.co_filename for c in codes))
    """)
    out = subprocess.run([sys.executable, "-c", probe], input=payload, check=True,
                         capture_output=True).stdout.decode().split()
    assert out and set(out) == {str(script)}, out


def test_a_bare_payload_roundtrip_keeps_the_file():
    ns = _defined_in("/srv/job/step.py")
    data = dumps_payload(ns["outer"], (3,), {})
    func = pickle.loads(data)[0]   # the first pickle: (func, args, kwargs, sources)
    assert func.__code__.co_filename == "/srv/job/step.py"


def test_cloudpickle_itself_is_left_as_its_release_makes_it():
    """The user's own cloudpickle.dumps in the same process: mplaunch registers nothing
    process-wide, so what it writes into code objects is cloudpickle's choice."""
    reduce = cloudpickle.Pickler.dispatch_table[types.CodeType]
    # cloudpickle's own, from whichever of its modules this release keeps it in
    # (cloudpickle_fast up to 2.2, cloudpickle from 3.0)
    assert reduce.__name__ == "_code_reduce", reduce
    assert reduce.__module__.split(".")[0] == "cloudpickle", reduce.__module__
    ns = _defined_in("/home/someone/train.py")
    expected = reduce(ns["outer"].__code__)[1]
    theirs = pickle.loads(cloudpickle.dumps(ns["outer"])).__code__.co_filename
    assert theirs in expected   # whatever this release writes, and nothing of ours


SUBMODULE_USERS = textwrap.dedent("""
    import concurrent, email, json, xml, os.path
    import xml.dom.minidom

    def attr_path():
        return concurrent.futures.ThreadPoolExecutor, xml.dom.minidom.parseString

    def nested_names():
        return email.mime.text, json.decoder, os.path.join

    def nothing_below():
        return json.dumps
""")


def _installed_search():
    """cloudpickle's submodule search as mplaunch wrapped it, in whichever module of the
    installed cloudpickle builds a function's state (cloudpickle_fast before 3.0)."""
    for name in ("cloudpickle.cloudpickle", "cloudpickle.cloudpickle_fast"):
        getstate = getattr(sys.modules.get(name), "_function_getstate", None)
        if getstate is not None:
            search = getstate.__globals__["_find_imported_submodules"]
            assert search._mplaunch
            return search
    raise AssertionError("this cloudpickle has no _function_getstate")


def _search_original(code, deps):
    return _installed_search().__defaults__[0](code, deps)


@pytest.mark.parametrize("name", ["attr_path", "nested_names", "nothing_below"])
def test_the_submodule_search_finds_what_cloudpickles_own_finds(name):
    import concurrent.futures  # noqa: F401 - imported, so both searches can find it
    import email.mime.text  # noqa: F401
    ns = _defined_in("/some/notebook/cell.py")
    exec(compile(SUBMODULE_USERS, "/some/notebook/cell.py", "exec"), ns)
    func = ns[name]
    deps = [v for k, v in ns.items() if isinstance(v, types.ModuleType)]
    ours = sorted(m.__name__ for m in pickler._submodules(func.__code__, deps))
    theirs = sorted(m.__name__ for m in _search_original(func.__code__, deps))
    assert ours == theirs
    if name != "nothing_below":
        assert ours        # the case is not vacuous
    # and a function pickled by mplaunch loads with those submodules imported
    assert pickle.loads(pickler.dumps(func))() == func()


def test_cloudpickle_outside_mplaunch_keeps_its_own_submodule_search(monkeypatch):
    calls = []
    search = _installed_search()
    original = search.__defaults__[0]
    monkeypatch.setattr(search, "__defaults__",
                        (lambda code, deps: calls.append(code) or original(code, deps),))
    ns = _defined_in("/some/notebook/cell.py")
    exec(compile(SUBMODULE_USERS, "/some/notebook/cell.py", "exec"), ns)
    cloudpickle.dumps(ns["attr_path"])
    assert calls == [ns["attr_path"].__code__]
    pickler.dumps(ns["attr_path"])
    assert len(calls) == 1      # mplaunch's own pickler did not use it
