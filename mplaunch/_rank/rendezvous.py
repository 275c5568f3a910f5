"""The rank's rendezvous: ``init_process_group()`` joins the store the launching process
already hosts on MASTER_PORT, instead of rank 0 starting a store there, in every form
that names that store: ``env://`` (the default), with or without ``rank=``/``world_size=``
(which torch turns into a URL query), and ``tcp://MASTER_ADDR:MASTER_PORT``. Any other
address, a ``file://`` URL or a ``store=`` is torch's business, as without mplaunch.

Key spaces. torch names the default group "0" again after every destroy (it resets its
group counter), and the store outlives the group: a new group built with the same store
writes and reads the very keys of the old one (gloo's peer addresses). A rank that is
quicker through destroy/init reads the old group's entries and connects to sockets that
are closing: "Connection reset by peer", or a hang in DDP's first collective. So every
rendezvous against mplaunch's store gets a key space of its own, ``pg<n>/``, where n
counts this rank's rendezvous (its incarnations). Ranks run the same code, so they count
alike; when a heal rebuilds the group the launching process sets one number for all of
them (a replaced rank starts at 0, its peers do not).

After the group. The hook also follows ``torch.distributed.init_process_group`` with
_rank.endpoints' note of the group's TCP connections (for the release of a healing
World; nothing in other ranks): the one moment the group is known to be up. Likewise
each subgroup, wherever torch makes it (_patch_subgroups).
"""
from __future__ import annotations

import os
import sys

from .._wire import linux
from . import endpoints


def install_hook() -> None:
    """Make init_process_group's env:// and tcp:// join the store the parent hosts, and
    have init_process_group tell _rank.endpoints when the group it made is up.

    Left alone, torch's handlers make rank 0 start a store server on MASTER_PORT, which
    the parent holds. torch's own agent-store switch (TORCHELASTIC_USE_AGENT_STORE)
    would fix that but also turns every tcp:// and user-created store into a client,
    which hangs; so only a URL that names our store is redirected: env:// while the
    rank's environment still names it, tcp:// to its address.
    """
    if "MPLAUNCH_STORE" not in os.environ:
        return
    for name, patch in (("torch.distributed.rendezvous", _patch_rendezvous),
                        ("torch.distributed", _patch_init)):
        mod = sys.modules.get(name)
        if mod is not None:
            patch(mod)
        else:
            sys.meta_path.insert(0, _PatchOnImport(name, patch))


class _PatchOnImport:
    """Patch module `target` as soon as it has been executed, before anything imports
    a name from it."""

    def __init__(self, target: str, patch):
        self.target, self.patch = target, patch

    def find_spec(self, name, path, target=None):
        if name != self.target:
            return None
        import importlib.util
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original = loader.exec_module
        patch = self.patch

        def exec_module(module):
            original(module)
            patch(module)

        loader.exec_module = exec_module
        return spec


def _patch_init(mod) -> None:
    """torch.distributed.init_process_group, followed by endpoints.group_made(): the
    one moment a group made through our store is known to be up, however user code or
    a framework calls it (``dist.init_process_group(...)``). A caller that took the
    function before this rank started (``from torch.distributed import
    init_process_group`` in the process a fork-mode rank was forked from) calls torch's
    own: its group's connections are not noted, and a collective of it left half-done
    is not released (the rank is replaced instead). mplaunch's own groups call
    group_made() themselves (_rank.procgroup)."""
    original = getattr(mod, "init_process_group", None)
    if original is None or getattr(original, "_mplaunch", False):
        return
    import functools

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        finally:
            endpoints.group_made()   # after a failed init: forgets the rendezvous

    init_process_group._mplaunch = 1  # type: ignore[attr-defined]
    mod.init_process_group = init_process_group
    _patch_subgroups(mod, sys.modules.get("torch.distributed.distributed_c10d"))


def _patch_subgroups(mod, c10d) -> None:
    """Each way torch makes a subgroup, followed by endpoints.subgroup_made(): a
    subgroup's connections are its own, and the release shuts them as the default
    group's.

    Where. Not at the name ``dist.new_group`` alone: torch's own helpers
    (new_subgroups, new_subgroups_by_enumeration, the functional collectives' groups)
    call distributed_c10d's new_group, and DeviceMesh (like any ``from
    torch.distributed import new_group`` run before this rank started) holds torch's
    function itself. Every new_group, in every torch mplaunch supports, makes its group
    in distributed_c10d's ``_new_process_group_helper``, which its callers look up by
    name at each call; so does init_process_group, which subgroup_started() tells apart
    (no default group yet). A split (split_group; DeviceMesh on a device bound to the
    group; new_group under torchcomms) makes its group in C++, in the parent's
    ``ProcessGroup.split_group``: wrapped on the class, which every caller reaches. A
    torch without the helper gets the name ``dist.new_group`` wrapped instead."""
    helper = getattr(c10d, "_new_process_group_helper", None)
    if helper is None:
        _patch_new_group(mod)
    elif not getattr(helper, "_mplaunch", False):
        c10d._new_process_group_helper = _noting(helper)
    process_group = getattr(c10d, "ProcessGroup", None)
    split = getattr(process_group, "split_group", None)
    if split is not None and not getattr(split, "_mplaunch", False):
        try:
            process_group.split_group = _noting(split, split=True)
        except (AttributeError, TypeError):
            pass   # a class that takes no attribute: its splits are not released


def _noting(original, split: bool = False):
    """`original`, a function that makes a group, with the group's connections noted.
    With `split`, a method of the parent group (ProcessGroup.split_group) returning the
    group or None; otherwise torch's helper, returning (group, its store)."""
    import functools

    if split:
        @functools.wraps(original)
        def made(self, *args, **kwargs):
            before = endpoints.subgroup_started()
            group = original(self, *args, **kwargs)
            # torch registers the split only after this returns: ask the parent's backend
            endpoints.subgroup_made(group, before, parent=self)
            return group
    else:
        @functools.wraps(original)
        def made(*args, **kwargs):
            before = endpoints.subgroup_started()
            out = original(*args, **kwargs)
            endpoints.subgroup_made(out[0] if isinstance(out, tuple) else out, before)
            return out

    made._mplaunch = 1  # type: ignore[attr-defined]
    return made


def _patch_new_group(mod) -> None:
    """torch.distributed.new_group, followed by endpoints.subgroup_made(): for a torch
    without _new_process_group_helper (see _patch_subgroups), whose other ways to a
    subgroup are then not released."""
    original = getattr(mod, "new_group", None)
    if original is None or getattr(original, "_mplaunch", False):
        return
    mod.new_group = _noting(original)


def _patch_rendezvous(mod) -> None:
    from .torchapi import rendezvous_handlers
    handlers = rendezvous_handlers(mod)
    if handlers is None:
        return   # a torch without the table: its own handlers, as without mplaunch
    for scheme in ("env", "tcp"):
        if scheme in handlers and not getattr(handlers[scheme], "_mplaunch", 0):
            handlers[scheme] = _joining(scheme, handlers[scheme])


def _joining(scheme: str, original):
    """torch's handler for `scheme`, joining mplaunch's store when the URL (tcp://) or
    the environment (env://) names it, torch's own handler otherwise: a user's own
    MASTER_ADDR/MASTER_PORT or tcp:// address gets its own store, as under torch.

    torch puts ``rank=`` and ``world_size=`` of init_process_group into the URL's query
    (``env://?rank=0&world_size=2``); frameworks (Lightning, accelerate) always pass them.
    They are accepted when they agree with the rank's environment, and refused with both
    values named when they do not (a wrong world size would otherwise wait for ranks that
    never come)."""

    def handler(url, timeout=None, **kwargs):
        from urllib.parse import parse_qs, urlparse

        from . import collectives
        collectives.start()  # torch.distributed is being initialised
        parsed = urlparse(url)
        store_at = _our_store()
        if scheme == "env":
            names_ours = store_at is not None and _same_place(
                (os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")),
                store_at)
        else:
            names_ours = store_at is not None and _same_place(
                (parsed.hostname or "", str(parsed.port or "")), store_at)
        if not names_ours:
            kw = dict(kwargs)
            if timeout is not None:
                kw["timeout"] = timeout
            yield from original(url, **kw)
            return
        rank, world_size = _agreed(parse_qs(parsed.query), url)
        from torch.distributed import PrefixStore, TCPStore
        host, port = store_at
        kw = {} if timeout is None else {"timeout": timeout}
        store = TCPStore(host, int(port), world_size, False, **kw)
        # A key space per group (the module's docstring says why)
        prefix = os.environ.get("MPLAUNCH_STORE_PREFIX", "") + next_key_space()
        group_store = PrefixStore(prefix, store)
        endpoints.rendezvous_started(store_at)
        yield (group_store, rank, world_size)
        raise RuntimeError(f"Unable to perform re-rendezvous using {scheme}:// method")

    handler._mplaunch = 1
    return handler


def _our_store():
    """(host, port) of the store the launching process holds, or None outside mplaunch."""
    host, _, port = os.environ.get("MPLAUNCH_STORE", "").rpartition(":")
    return (host, port) if host and port else None


_LOOPBACK = ("127.0.0.1", "localhost", "::1", "ip6-localhost")


def _same_place(at, store_at) -> bool:
    """Whether `at` names the store: the same port, and the same host or both loopback
    (the DDP tutorial writes MASTER_ADDR="localhost" where mplaunch wrote 127.0.0.1)."""
    (host, port), (our_host, our_port) = at, store_at
    if port != our_port:
        return False
    return host == our_host or (host in _LOOPBACK and our_host in _LOOPBACK)


def _agreed(query: dict, url: str):
    """(rank, world_size): the environment's, after checking what the caller passed."""
    env = {"rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}
    for key, ours in env.items():
        given = query.get(key)
        if not given:
            continue
        try:
            value = int(given[-1])
        except ValueError:
            raise ValueError(f"init_process_group: {key}={given[-1]!r} in {url!r} is not "
                             "an integer") from None
        if value != ours:
            where = "WORLD_SIZE" if key == "world_size" else "RANK"
            raise ValueError(
                f"init_process_group({key}={value}) contradicts this rank's environment: "
                f"mplaunch started it with {where}={ours} "
                f"(RANK={env['rank']}, WORLD_SIZE={env['world_size']}). Pass "
                f"{key}=int(os.environ[{where!r}]), or leave {key} out and let env:// "
                "read it; a different world needs a different nprocs (or nnodes).")
    return env["rank"], env["world_size"]


# -- key spaces ------------------------------------------------------------------------

_incarnation = 0


def next_key_space() -> str:
    """The store prefix of the next group this rank builds (called by the hook)."""
    global _incarnation
    n = _incarnation
    _incarnation += 1
    return f"pg{n}/"


def incarnation() -> int:
    return _incarnation


def set_incarnation(n: int) -> None:
    global _incarnation
    _incarnation = n


# -- start_method="fork" ---------------------------------------------------------------

def close_inherited_store_sockets() -> int:
    """In a rank forked from the launching process (start_method="fork"), close the
    copies of the store server's sockets (its listening socket and its connections to
    the other ranks) that the fork inherited; the number closed.

    The server's event loop (libuv, epoll) registered those sockets; epoll keeps a
    registration while any copy of the socket is open, so after the server closed a
    connection (a rank that died) our copy kept reporting its events under an fd
    number the server had closed, and could then reuse: seen as a store that no longer
    answers a replaced rank's rendezvous. Those fds belong to C++ objects of the
    launching process, never to a Python object of ours, so closing them is safe."""
    store = os.environ.get("MPLAUNCH_STORE", "")
    _, _, port = store.rpartition(":")
    if not port.isdigit():
        return 0
    closed = 0
    for fd in linux.socket_fds(os.getpid()):
        ends = linux.socket_ends(fd)   # the socket itself, not the machine's TCP table
        if ends is not None and ends[0][1] == int(port):
            closed += linux.close_quiet(fd)
    return closed
