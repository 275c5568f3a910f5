"""Which payload each node's agent holds, in a World across nodes: a start's or a call's
payload (its large inputs included) crosses to a node once, whatever the number of its
ranks, and the records that start or call them (_wire.link.StartRank, ToRank) name it by
its key. The Hub owns its nodes' one NodePayloads (Hub.start_rank, call_rank,
drop_payloads); each node's NodeInfo.payloads counts the payloads it was sent.

One payload per node at a time: the agent keeps the last one it was sent (its ranks
map their own copies of what they use), and the next one, a Drop or the group's end
frees it. The key is the file's (device, inode), unique while the file is open: this side
holds a dup of the file for as long as a node holds it, so that no new file can take the
key meanwhile.

Rejected: the payload's bytes in every rank's start or call record (before): one copy
per rank over the network and in the agent's memory. And a per-node cache of several
payloads: a rank that dropped its inputs would find them kept alive on its node.
"""
from __future__ import annotations

import os
import threading
from typing import Callable, Dict, List, Tuple

from .. import servers
from ..._wire import tunnel
from ..._wire.link import Drop, Payload

__mplaunch_plumbing__ = True


class NodePayloads:
    """The payload each link's agent holds. Thread-safe: starts come from the group's
    thread, calls from the pump's."""

    def __init__(self):
        self._lock = threading.Lock()
        self._held: Dict[int, Tuple[Tuple[int, int], int]] = {}   # node -> (key, our dup)

    def send(self, link, fds: List[int], record: Callable[[list], object]) -> bool:
        """Send the record `record(keys)`, which names the payloads in `fds` by their
        keys, each sent to the link's node first unless it holds it already; False if
        the link is lost."""
        with self._lock:
            keys = []
            for fd in fds:
                key = self._ensure(link, fd)
                if key is None:
                    return False
                keys.append(key)
            return link.send(record(keys))

    def _ensure(self, link, fd: int):
        node = link.info.slot   # (renumbered links keep it)
        key = tunnel.payload_key(fd)
        held = self._held.get(node)
        if held is not None and held[0] == key:
            return key
        if held is not None:
            self._drop(node)
            if not link.send(Drop(held[0])):
                return None
        if not link.send(Payload(key, fd)):
            return None
        self._held[node] = (key, servers.own_fd(os.dup(fd)))
        link.info.payloads += 1
        return key

    def _drop(self, node: int) -> None:
        held = self._held.pop(node, None)
        if held is not None:
            servers.close_fd(held[1])

    def forget(self, node: int) -> None:
        """Node `node` (its slot) was replaced, or left the World: nothing held there."""
        with self._lock:
            self._drop(node)

    def clear(self) -> None:
        """The group ended: its agents dropped theirs (CloseGroup)."""
        with self._lock:
            for node in list(self._held):
                self._drop(node)
