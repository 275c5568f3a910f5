"""The rank's env:// rendezvous: ``init_process_group()`` joins the store the launching
process already hosts on MASTER_PORT, instead of rank 0 starting a store there.
"""
from __future__ import annotations

import os
import sys


def install_hook() -> None:
    """Make init_process_group("env://") join the store the parent already hosts.

    Left alone, torch's env:// handler makes rank 0 start a store server on
    MASTER_PORT, which the parent holds. torch's own agent-store switch
    (TORCHELASTIC_USE_AGENT_STORE) would fix that but also turns every tcp:// and
    user-created store into a client, which hangs; so only env:// pointing at our store is
    redirected, and only when the rank's environment still names it.
    """
    if "MPLAUNCH_STORE" not in os.environ:
        return
    mod = sys.modules.get("torch.distributed.rendezvous")
    if mod is not None:
        _patch_rendezvous(mod)
    else:
        sys.meta_path.insert(0, _PatchOnImport())


class _PatchOnImport:
    target = "torch.distributed.rendezvous"

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

        def exec_module(module):
            original(module)
            _patch_rendezvous(module)

        loader.exec_module = exec_module
        return spec


def _patch_rendezvous(mod) -> None:
    handlers = getattr(mod, "_rendezvous_handlers", None)
    if handlers is None or "env" not in handlers or getattr(handlers["env"], "_mplaunch", 0):
        return
    original = handlers["env"]

    def env_handler(url, timeout=None, **kwargs):
        from . import collectives
        collectives.start()  # torch.distributed is being initialised
        host, _, port = os.environ.get("MPLAUNCH_STORE", "").rpartition(":")
        if (not host or os.environ.get("MASTER_ADDR") != host
                or os.environ.get("MASTER_PORT") != port or "?" in url):
            kw = dict(kwargs)
            if timeout is not None:
                kw["timeout"] = timeout
            yield from original(url, **kw)
            return
        from torch.distributed import PrefixStore, TCPStore
        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
        kw = {} if timeout is None else {"timeout": timeout}
        store = TCPStore(host, int(port), world_size, False, **kw)
        # A key space per group: see pgroup (why a reused one hangs or resets).
        from .pgroup import next_key_space
        prefix = os.environ.get("MPLAUNCH_STORE_PREFIX", "") + next_key_space()
        store = PrefixStore(prefix, store)
        yield (store, rank, world_size)
        raise RuntimeError("Unable to perform re-rendezvous using env:// method")

    env_handler._mplaunch = 1
    handlers["env"] = env_handler
