"""The shape of the package: which process's code may import what, what importing mplaunch
costs, and that the public surface is still there when nothing is imported eagerly.

mplaunch is three programs and the contract between them. The folders say which is which:

- ``_wire``: what crosses a process boundary (messages, framing, specs, payloads,
  exceptions, stacks, Linux primitives). Imports nothing else of mplaunch but ``errors``.
- ``_rank``: the rank and its own children. Imports ``_wire`` and ``errors`` only, so a
  DataLoader worker of a rank never loads the launching side.
- ``_server``: the warm server. Its forked children become ranks, so it may import
  ``_rank`` as well.
- ``_engine``: the launching process's machinery. Imports ``_wire`` and ``errors``; the one
  exception is the fork spawner, whose child *is* a rank. A World across nodes is
  ``_engine.nodes`` (its schedulers behind one seam, ``schedulers``: only their own
  modules name one); launch() as one launcher per node is ``_engine.tasks``. The two
  share nothing.
- ``_agent``: a node's agent, a process of its own on each node of a World across nodes.
  It runs its node's share with the engine's servers and spawners, so it may import
  ``_engine``; nothing imports it (it is started with ``python -m``).
- the front-ends (``_launch``, ``_handle``, ``_world``, ``_magic``, ``_cli``, the pytest
  plugin) sit on top and may import anything.
"""
from __future__ import annotations

import ast
import json
import os
import pickle
import re
import subprocess
import sys

import pytest

import mplaunch

PKG = os.path.dirname(os.path.abspath(mplaunch.__file__))
ROOT = os.path.dirname(PKG)
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
no_torch = pytest.mark.no_torch

# layer -> the layers it may import (itself always)
ALLOWED = {
    "errors": {"_wire"},
    "_wire": {"errors"},
    "_rank": {"_wire", "errors"},
    "_server": {"_wire", "_rank", "errors"},
    "_engine": {"_wire", "errors"},
    "_agent": {"_engine", "_wire", "errors"},
}
# (importing module, imported module): the exceptions, each with its reason
EXCEPTIONS = {
    # start_method="fork": the forked child of the launching process becomes the rank
    ("mplaunch._engine.spawners", "mplaunch._rank.worker"),
}


def _modules():
    for dirpath, _dirs, files in os.walk(PKG):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                yield rel.removesuffix(".__init__"), path


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _is_module(dotted: str) -> bool:
    base = os.path.join(ROOT, *dotted.split("."))
    return os.path.exists(base + ".py") or os.path.exists(os.path.join(base, "__init__.py"))


def _imports(module: str, path: str):
    """Every mplaunch module `module` imports, at any depth of its code."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    is_pkg = path.endswith("__init__.py")
    package = module if is_pkg else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("mplaunch."):
                    yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target != "mplaunch" and not target.startswith("mplaunch."):
                continue
            yield target
            for alias in node.names:  # `from .._engine import servers`: a submodule
                sub = f"{target}.{alias.name}"
                if _is_module(sub):
                    yield sub


@no_torch
def test_each_process_imports_only_what_its_layer_may():
    bad = []
    for module, path in _modules():
        layer = _layer(module)
        if layer not in ALLOWED:
            continue  # a front-end
        for target in _imports(module, path):
            tlayer = _layer(target)
            if tlayer == layer or tlayer in ALLOWED[layer] or tlayer == "__version__":
                continue
            if (module, target) in EXCEPTIONS:
                continue
            bad.append(f"{module} imports {target}")
    assert not bad, "\n".join(bad)


@no_torch
def test_nothing_imports_the_agent_which_the_step_starts_by_its_module_name():
    from mplaunch._engine.nodes import agents
    assert agents.AGENT_MODULE == "mplaunch._agent.agent"
    assert _is_module(agents.AGENT_MODULE)
    importers = [f"{module} imports {target}" for module, path in _modules()
                 if _layer(module) != "_agent" for target in _imports(module, path)
                 if _layer(target) == "_agent"]
    assert not importers, importers


@no_torch
def test_the_rule_checker_sees_relative_and_nested_imports(tmp_path):
    # A checker that finds nothing proves nothing: feed it the shapes the rules forbid.
    src = tmp_path / "m.py"
    src.write_text("from ..errors import X\nfrom .._engine import servers\n"
                   "def f():\n    from .._engine.group import RankGroup\n")
    found = set(_imports("mplaunch._rank.m", str(src)))
    assert found == {"mplaunch.errors", "mplaunch._engine", "mplaunch._engine.servers",
                     "mplaunch._engine.group"}


def _run(code: str, env=None) -> str:
    full_env = dict(os.environ, PYTHONPATH=ROOT)
    full_env.update(env or {})
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=full_env, timeout=120, check=True)
    return out.stdout


_LOADED = ("import json, sys; print(json.dumps(sorted(m for m in sys.modules "
           "if m == 'mplaunch' or m.startswith('mplaunch.'))))")


@no_torch
def test_import_mplaunch_imports_nothing_of_it_but_the_package():
    assert json.loads(_run("import mplaunch; " + _LOADED)) == ["mplaunch"]
    heavy = json.loads(_run("import mplaunch; " + _LOADED.replace(
        "if m", "if m.split('.')[0] in ('torch', 'cloudpickle', 'tblib', 'numpy') or m")))
    assert heavy == ["mplaunch"]


@no_torch
def test_loading_the_pytest_plugin_imports_nothing_else_of_mplaunch():
    loaded = json.loads(_run("import pytest, mplaunch.pytest_plugin; " + _LOADED))
    assert loaded == ["mplaunch", "mplaunch.pytest_plugin"]


@no_torch
def test_public_names_resolve_lazily_and_are_listed():
    code = ("import mplaunch, json; names = dir(mplaunch); "
            "print(json.dumps([names, [getattr(mplaunch, n).__name__ for n in "
            "mplaunch.__all__ if n != '__version__']]))")
    names, resolved = json.loads(_run(code))
    for name in mplaunch.__all__ + ["load_ipython_extension", "unload_ipython_extension"]:
        assert name in names
    assert resolved == [n for n in mplaunch.__all__ if n != "__version__"]
    with pytest.raises(AttributeError, match="no attribute 'lunch'"):
        mplaunch.lunch  # noqa: B018


@no_torch
def test_help_shows_the_public_functions():
    text = _run("import mplaunch, pydoc; print(pydoc.render_doc(mplaunch, renderer=pydoc.plaintext))")
    # (Python 3.13 puts a long signature's parameters on lines of their own.)
    for pattern in (r"launch\(\s*func", r"start\(\s*func", "class World",
                    "class WorkerError", "rank_state"):
        assert re.search(pattern, text), pattern


@no_torch
def test_errors_pickled_by_the_flat_layout_still_load():
    # Made by the last version before the folders (c5fce2f) from real launches: a rank that
    # raised, a timeout with two stuck ranks, and errors built by hand.
    with open(os.path.join(DATA, "errors-c5fce2f.pickle"), "rb") as f:
        old = pickle.load(f)
    for key in ("timeout", "main", "remote"):
        assert str(old[key]) == old["texts"][key]
    # (the failing line's path is shown relative to the current directory)
    assert str(old["worker"]).split(" (at ")[0] == old["texts"]["worker"].split(" (at ")[0]
    worker = old["worker"]
    assert isinstance(worker, mplaunch.WorkerError) and worker.rank == 1
    assert worker.failures[0].exc_type == "ValueError"
    timeout = old["timeout"]
    assert isinstance(timeout, mplaunch.LaunchTimeout) and sorted(timeout.stacks) == [0, 1]
    assert old["main"].signal_no == 2
    assert old["failure"].signal == "SIGKILL" and old["failure"].rank == 3
    assert pickle.loads(pickle.dumps(worker)).failures == worker.failures


def _sizes():
    for module, path in _modules():
        with open(path) as f:
            text = f.read()
        tree = ast.parse(text, path)
        yield module, "module", len(text.splitlines())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                yield f"{module}.{node.name}", "class", node.end_lineno - node.lineno + 1


@no_torch
def test_no_module_or_class_has_grown_past_what_one_reader_holds():
    limits = {"module": 450, "class": 320}
    big = [f"{name}: {kind} of {n} lines" for name, kind, n in _sizes() if n > limits[kind]]
    assert not big, "split these (see docs/how-it-works.rst for the layout):\n" + "\n".join(big)


_CHILD_PROBE = r"""
import json, multiprocessing as mp, os, sys
import mplaunch

def child(q):
    q.put(sorted(m for m in sys.modules if m == "mplaunch" or m.startswith("mplaunch.")))

def rank():
    ctx = mp.get_context(os.environ["PROBE_CONTEXT"])
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    mods = q.get(timeout=120)
    p.join()
    return mods

if __name__ == "__main__":
    print(json.dumps(mplaunch.launch(rank, nprocs=1)[0]))
"""


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_a_ranks_children_rebuild_main_without_the_launching_side(tmp_path, context):
    script = tmp_path / "probe.py"
    script.write_text(_CHILD_PROBE)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=ROOT,
                                                PROBE_CONTEXT=context))
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "mplaunch._wire.mainmod" in loaded
    outside = [m for m in loaded if _layer(m) not in ("__init__", "_rank", "_wire", "errors")]
    assert not outside, outside


def _import_graph() -> dict:
    """module -> the mplaunch modules it imports, lazy (nested) imports included."""
    return {module: {t for t in _imports(module, path) if t != module}
            for module, path in _modules()}


def _cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            for t in targets:
                if t not in graph:
                    continue
                if t not in index:
                    index[t] = low[t] = len(index)
                    stack.append(t)
                    on_stack.add(t)
                    work.append((t, iter(sorted(graph[t]))))
                    break
                if t in on_stack:
                    low[node] = min(low[node], index[t])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        component.append(m)
                        if m == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


@no_torch
def test_no_import_cycle_in_the_package():
    cycles = _cycles(_import_graph())
    assert not cycles, "import cycles (lazy imports count):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


@no_torch
def test_the_cycle_finder_finds_a_cycle_through_a_lazy_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


# What a rank has loaded after running each front-end's payload: mplaunch's rank side
# and wire only, and the server it was forked from. (start_method="fork" is left out:
# there the rank is a fork of the launching process and has whatever it had.)
RANK_SIDE = ("__init__", "_rank", "_wire", "errors", "_server")
def _loaded():
    import sys
    return sorted(m for m in sys.modules if m == "mplaunch" or m.startswith("mplaunch."))


def _launching_side(loaded):
    return [m for m in loaded if _layer(m) not in RANK_SIDE]


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_the_payloads_of_launch_and_world_load_nothing_of_the_launching_side(start_method):
    assert _launching_side(mplaunch.launch(_loaded, nprocs=1,
                                           start_method=start_method)[0]) == []
    with mplaunch.World(nprocs=2, start_method=start_method) as world:
        world.run(lambda: None)
        for loaded in world.run(_loaded):
            assert "mplaunch._rank.call_loop" in loaded
            assert _launching_side(loaded) == [], loaded


def test_a_plugin_tests_ranks_load_nothing_of_the_launching_side(pytester):
    pytester.makepyfile(f"""
        import sys, pytest
        LAYERS = ("__init__", "_rank", "_wire", "errors", "_server")

        def outside():
            loaded = [m for m in sys.modules if m.startswith("mplaunch.")]
            return [m for m in loaded if m.split(".")[1] not in LAYERS]

        @pytest.mark.mplaunch(nprocs=2)
        def test_once():
            assert outside() == []

        @pytest.mark.mplaunch(nprocs=2, reuse=True)
        def test_reused():
            assert outside() == []
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=150)
    result.assert_outcomes(passed=2)


@no_torch
def test_the_interrupt_guard_knows_mplaunchs_plumbing_by_the_modules_own_word(monkeypatch):
    """A healing World's SIGINT is dropped in mplaunch's own frames: the modules say so
    themselves (a rename cannot silently break it), and user code is not among them.
    Outside a call's window it is dropped everywhere, and so is a second one that comes
    right after the first raised."""
    import importlib
    import types

    from mplaunch._rank import call_loop as serve
    plumbing = ["mplaunch._rank.call_loop", "mplaunch._rank.worker", "mplaunch._rank.streams",
                "mplaunch._wire.channel", "mplaunch._wire.linux", "mplaunch._wire.messages"]
    for name in plumbing:
        assert getattr(importlib.import_module(name), serve.PLUMBING, False) is True, name

    def frame_in(namespace):
        code = compile("import sys\nframe = sys._getframe()", "<x>", "exec")
        exec(code, namespace)
        return namespace["frame"]

    user = frame_in({"__name__": "__main__"})
    monkeypatch.setattr(serve, "_raised_at", 0.0)
    serve._on_sigint(2, user)              # no call's window open: dropped
    serve.accept_interrupts(True)
    try:
        serve._on_sigint(2, frame_in(dict(vars(importlib.import_module(plumbing[1])))))
        with pytest.raises(KeyboardInterrupt):
            serve._on_sigint(2, user)
        serve._on_sigint(2, user)          # on its way to the call's handler: dropped
        monkeypatch.setattr(serve, "_raised_at", 0.0)
        with pytest.raises(KeyboardInterrupt):
            serve._on_sigint(2, frame_in(dict(vars(types))))
    finally:
        serve.accept_interrupts(False)



# -- one seam per scheduler -------------------------------------------------------------
# The modules whose code may name a scheduler (a name, an option or a variable of its,
# as a word in a string; or by importing its module), each with its reason. Docstrings,
# comments and texts (a string with a space: an error, a help) may name any: they
# explain, they do not decide.
SCHEDULER_NAMERS = {
    "mplaunch._engine.nodes.schedulers": "the registry: the built-in schedulers by name",
    "mplaunch._engine.nodes.slurm_step": "SLURM, as a World's scheduler",
    "mplaunch._engine.nodes.ray_step": "Ray, as a World's scheduler",
    "mplaunch._engine.nodes.ray_actor": "Ray, as a World's scheduler: what runs on the "
                                        "cluster (the agent actor) and its checks",
    "mplaunch._engine.tasks.slurm": "launch() as one srun task per node reads its layout "
                                    "from SLURM, and a rank in a step is a task of its own",
    "mplaunch._rank.worker": "a rank's SLURM_TASK_PID is its own pid, known only there",
}
_SCHEDULER_WORD = re.compile(r"(?i)(?<![a-z])(slurm|ray|srun|salloc|sbatch)(?![a-z])")
_SCHEDULER_MODULE = re.compile(r"^ray(\.|$)|(^|\.)\w+_step(\.|$)")


def _docstrings(tree) -> set:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                             ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _names_a_scheduler(path: str, module: str) -> list:
    """Where the code of `path` names a scheduler: its words in strings (not texts, not
    docstrings) and its imports of a scheduler's module (or of Ray's own package)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    docs = _docstrings(tree)
    said = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docs and " " not in node.value.strip() \
                and _SCHEDULER_WORD.search(node.value):
            said.append(f"line {node.lineno}: {node.value[:60]!r}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            if any(_SCHEDULER_MODULE.search(n) for n in names):
                said.append(f"line {node.lineno}: imports {names}")
    return said


@no_torch
def test_only_the_schedulers_own_modules_name_a_scheduler():
    bad = {module: said for module, path in _modules()
           if module not in SCHEDULER_NAMERS
           for said in [_names_a_scheduler(path, module)] if said}
    assert not bad, "\n".join(f"{m}: {s}" for m, s in bad.items())
    for module in SCHEDULER_NAMERS:   # none stale
        assert _is_module(module), module


@no_torch
def test_the_scheduler_checker_sees_strings_and_imports_not_docstrings(tmp_path):
    src = tmp_path / "m.py"
    src.write_text('"""Runs on SLURM or Ray."""\nfrom .nodes import ray_step\n'
                   'def f():\n    """srun it."""\n    return "slurm", "array", "x_ray", \\\n'
                   '        "needs SLURM", "SLURM_JOB_ID"\n'
                   'import ray.util\nfrom .tasks import slurm\n')
    said = _names_a_scheduler(str(src), "mplaunch._engine.m")
    assert sorted(s.split(":")[0] for s in said) == ["line 2", "line 5", "line 5", "line 6",
                                              "line 7"], said


@no_torch
def test_each_builtin_scheduler_is_one_module_offering_the_seam():
    from mplaunch._engine.nodes import schedulers
    for name, module in schedulers._BUILTIN.items():
        factory = schedulers._factory(name)
        assert factory.__module__ == module and factory.name == name
        assert isinstance(factory(), schedulers.Scheduler), name
        assert isinstance(factory.about, str) and isinstance(factory.options, tuple)
    with pytest.raises(ValueError, match="registered already"):
        schedulers.register("slurm", schedulers._factory("slurm"))
    with pytest.raises(ValueError, match="one of 'slurm', 'ray'.*got 'k8s'"):
        schedulers.choose("k8s")


@no_torch
def test_a_worlds_nodes_and_launchs_tasks_are_two_mechanisms_that_share_nothing():
    crossing = [f"{module} imports {target}" for module, path in _modules()
                for target in _imports(module, path)
                for a, b in (("_engine.nodes", "_engine.tasks"),
                             ("_engine.tasks", "_engine.nodes"))
                if f"mplaunch.{a}" in module + "." and target.startswith(f"mplaunch.{b}")]
    assert not crossing, crossing
