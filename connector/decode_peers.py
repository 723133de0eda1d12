# SPDX-License-Identifier: Apache-2.0
"""A prefill rank's decode peers: their NIXL agents loaded and unloaded as the registrar's engine events come, their page tables prepared.

A decode engine that leaves, or comes back with a new incarnation, has its
ranks retired: their agents are unloaded only once no WRITE to them is in
flight, and a rank whose agent registers again before that keeps it.

DecodePeers is a part of ProducerCore (producer.py), which keeps the records
(_peers, _retiring, _local_prepared, _computing, _orders, _jobs); split out so
the transfer state machine reads on its own.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvpush.connector.write_plans import Peer, PeerRank, device_of, page_table_of
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb

if TYPE_CHECKING:
    from kvpush.connector.producer import Transport
    from kvpush.connector.producer_records import Computing, Job, Key, Order
    from kvpush.connector.write_plans import LocalLayout

logger = logging.getLogger(__name__)


class DecodePeers:
    """ProducerCore's decode peers (a mixin: the state it reads and writes is the core's)."""

    if TYPE_CHECKING:  # ProducerCore's, declared for the type checker only
        transport: Transport
        local: LocalLayout
        _computing: dict[Key, Computing]
        _orders: dict[Key, Order]
        _jobs: dict[Key, Job]
        _peers: dict[str, Peer]
        _retiring: list[PeerRank]
        _local_prepared: object | None

        def _try_start(self, key: Key) -> None: ...
        def _discard_made(self, computing: Computing) -> None: ...

    def engine_event(self, event: reg_pb.WatchEnginesResponse) -> None:
        engine = event.engine
        peer = self._peers.get(engine.engine_id)
        if event.type == reg_pb.ENGINE_EVENT_TYPE_REMOVED or (peer is not None and peer.incarnation != engine.incarnation):
            if peer is not None:
                del self._peers[engine.engine_id]
                for computing in self._computing.values():
                    if computing.made is not None and computing.made.peer is peer:
                        self._discard_made(computing)  # freed before the peer's agent is unloaded
                for rank in peer.ranks.values():
                    self._retire(rank)
            if event.type == reg_pb.ENGINE_EVENT_TYPE_REMOVED:
                return
            peer = None
        if peer is None:
            peer = self._peers[engine.engine_id] = Peer(engine.incarnation, {})
        for registered in engine.ranks:
            tp = registered.rank.tp_rank
            if tp in peer.ranks:
                continue
            returning = self._unretire(registered.nixl.agent_name)
            if returning is not None:
                peer.ranks[tp] = returning
                continue
            name = self.transport.add_peer(registered.nixl.agent_metadata)
            self.transport.warm_up(name)
            peer.ranks[tp] = self._prepare(PeerRank(name, registered.layout))
        for key in list(self._orders):
            self._try_start(key)

    def _retire(self, rank: PeerRank) -> None:
        """Unloads a peer rank's agent once no WRITE to it is in flight (_unload_retired does it, each step)."""
        self._retiring.append(rank)

    def _unretire(self, agent: str) -> PeerRank | None:
        """A retiring rank whose agent came back before it was unloaded (its lease lapsed, then it registered again).

        The agent is still loaded: it stays, with its prepared page table;
        unloading it now would leave the engine's new entry without one.
        """
        rank = next((r for r in self._retiring if r.agent == agent), None)
        if rank is not None:
            self._retiring.remove(rank)
        return rank

    def _prepare(self, rank: PeerRank) -> PeerRank:
        """Prepares the peer rank's page table (and this rank's, once) when both sides have one: WRITEs then post by index."""
        if self.local.pages is None:
            return rank
        rank.pages = page_table_of(rank.layout, self.local.layers)  # a stage writes its layers of the peer's
        if rank.pages is None:
            return rank
        try:
            if self._local_prepared is None:
                self._local_prepared = self.transport.prepare_pages(None, self.local.pages.rows(self.local.device))
            rank.prepared = self.transport.prepare_pages(rank.agent, rank.pages.rows(device_of(rank.layout)))
        except Exception:  # WRITEs to this rank build descriptor lists per request instead
            logger.exception("kvpush producer: preparing the page table of %s failed", rank.agent)
        return rank

    def _unload_retired(self) -> None:
        """Unloads the retired ranks' agents that no WRITE in flight uses any more."""
        if self._retiring:
            in_use = {w.peer for job in self._jobs.values() for w in job.writes}
            for rank in [r for r in self._retiring if r.agent not in in_use]:
                if rank.prepared is not None:
                    self.transport.forget_pages(rank.prepared)
                self.transport.remove_peer(rank.agent)
                self._retiring.remove(rank)
