"""Who is in a RankGroup, in a healing World: a dead rank replaced by a fresh process
(replace), and a World across nodes that goes on without a lost node's ranks, the
others renumbered (renumber: _engine.nodes.going_on). A part of RankGroup
(_engine.group), which owns its ranks' life; here only the changes of who they are.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from .output import relay_pending
from .ranks import RankState
from .._wire.spec import RankSpec


class Membership:
    """RankGroup's changes of its ranks (a mixin: the group's fields are its own)."""

    def replace(self, index: int, payload_fd: int, spec=None) -> RankState:
        """A fresh process for a dead rank, by the path that started it (a healing World:
        _engine.world_engine; `spec`: on its node's replacement); its first call is the
        payload in `payload_fd`. The old one's last output is relayed and its fds closed.
        Returns once it has a pid."""
        old = self.ranks[index]
        self._let_go(old)
        # Its group comes from its first call (a rebuild in key space n with the others),
        # not from the set-up that a spec's backend asks for (key space 0).
        self._specs[index] = spec or self._specs[index]
        new = RankState(dataclasses.replace(self._specs[index], backend=None))
        new.token = old.token
        self.ranks[index] = new
        self._start_one(new, payload_fd)
        while new.pid is None and new.alive:
            self.spawner.pump()
        return new

    def renumber(self, keep: Sequence[int], specs: Sequence[RankSpec], cfg) -> dict:
        """Go on with the ranks at `keep` (a World going on without a lost node:
        World.restart(nnodes=M)), in order, each numbered as in its spec of the new
        layout (`specs`, `cfg`); the others, dead with their node, are let go of. What
        changes in each live one's environment ({old rank: {name: value, or None where
        it goes}}), for it to follow."""
        kept = set(keep)
        gone = [r for i, r in enumerate(self.ranks) if i not in kept]
        for r in gone:
            self._let_go(r)
            self._tokens.pop(r.token, None)
        self.spawner.forget([r.token for r in gone])
        changes = {}
        for i, new in zip(keep, specs):
            r, old = self.ranks[i], self._specs[i]
            if r.alive:
                changes[r.spec.rank] = {k: new.env.get(k) for k in {*old.env, *new.env}
                                        if old.env.get(k) != new.env.get(k)}
            self._specs[i] = new   # whole: a dead rank's node may be a replacement
            own = {k: v for k, v in r.spec.env.items() if k not in old.env}  # a terminal's
            r.spec = dataclasses.replace(r.spec, rank=new.rank, node_rank=new.node_rank,
                                         env={**new.env, **own})
            for relay in (r.out, r.err):
                if relay is not None:
                    relay.retitle(r.spec.prefix(cfg.prefix))
        self.ranks = [self.ranks[i] for i in keep]
        self._specs = [self._specs[i] for i in keep]
        self.cfg = cfg
        return changes

    def _let_go(self, r: RankState) -> None:
        """A dead rank's last output relayed, its fds closed."""
        relay_pending(r, end_line=False)   # all there is: the writer is dead
        for fileobj in (r.reader and r.reader.sock, r.out_fd, r.err_fd, r.stack_fd):
            if fileobj is not None:
                self._unregister(fileobj)
        r.close()
