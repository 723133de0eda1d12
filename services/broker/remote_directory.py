# SPDX-License-Identifier: Apache-2.0
"""The broker's engine directory when it runs apart from the registrar: a mirror kept by WatchEngines.

Each (re)connection opens the watch, waits until the registrar confirms it
(initial metadata), then lists the engines and makes that listing the
mirror; watch events apply from there on. Changes between the watch
opening and the listing appear in both and converge. Engines that vanished
while the broker was disconnected are reported to the removal listeners at
the resync. Every snapshot replaced is replaced by a new object, as
EngineDirectory requires.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import grpc

from kvpush.client.backoff import Backoff
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.registrar.v1 import registrar_service_pb2_grpc as reg_grpc

logger = logging.getLogger(__name__)

RESYNC_REASON = "REGISTRAR_RESYNC"


def _positions(engine: reg_pb.Engine) -> set[tuple[int, int]]:
    return {(r.rank.tp_rank, r.rank.pp_rank) for r in engine.ranks}


class RemoteEngineDirectory:
    """Mirrors a remote registrar's engines; implements the broker's EngineDirectory."""

    def __init__(
        self,
        stub: reg_grpc.RegistrarServiceStub,
        *,
        metadata: Sequence[tuple[str, str]] = (),
        rpc_timeout_s: float = 5.0,
        watch_renew_s: float = 600.0,
        max_backoff_s: float = 5.0,
    ):
        self._stub = stub
        self._metadata = tuple(metadata)
        self._rpc_timeout_s = rpc_timeout_s
        self._watch_renew_s = watch_renew_s
        self._max_backoff_s = max_backoff_s
        self._engines: dict[str, reg_pb.Engine] = {}
        self._listeners: list[Callable[[str, str, str], None]] = []
        self.synced = asyncio.Event()

    def get_engine(self, engine_id: str) -> reg_pb.Engine | None:
        return self._engines.get(engine_id)

    def add_removal_listener(self, listener: Callable[[str, str, str], None]) -> None:
        self._listeners.append(listener)

    async def run(self) -> None:
        """Keeps the mirror current until cancelled, reconnecting with capped exponential backoff."""
        backoff = Backoff(0.1, self._max_backoff_s)
        while True:
            try:
                await self._follow()
                backoff.reset()  # the watch ran to its renewal time or the registrar closed it
            except (grpc.aio.AioRpcError, TimeoutError) as exc:
                detail = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else "timed out"
                if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and self.synced.is_set():
                    backoff.reset()  # the watch reached its renewal deadline
                    continue
                logger.warning("engine watch on the registrar failed (%s); retrying in %.1fs", detail, backoff.delay_s)
                await backoff.sleep()

    async def _follow(self) -> None:
        call = self._stub.WatchEngines(reg_pb.WatchEnginesRequest(), timeout=self._watch_renew_s, metadata=self._metadata)
        try:
            async with asyncio.timeout(self._rpc_timeout_s):
                await call.initial_metadata()
            listing = await self._stub.ListEngines(reg_pb.ListEnginesRequest(), timeout=self._rpc_timeout_s, metadata=self._metadata)
            self._replace_all(listing.engines)
            self.synced.set()
            async for event in call:
                self._apply(event)
        finally:
            call.cancel()

    def _replace_all(self, engines) -> None:
        previous = self._engines
        self._engines = {engine.engine_id: engine for engine in engines}
        for engine_id, old in previous.items():
            new = self._engines.get(engine_id)
            if new is None or new.incarnation != old.incarnation or _positions(old) - _positions(new):
                self._notify(old, RESYNC_REASON)

    def _apply(self, event: reg_pb.WatchEnginesResponse) -> None:
        engine = event.engine
        old = self._engines.get(engine.engine_id)
        if event.type == reg_pb.ENGINE_EVENT_TYPE_REMOVED:
            if old is not None and old.incarnation == engine.incarnation:
                del self._engines[engine.engine_id]
                self._notify(old, event.reason)
            return
        if event.type != reg_pb.ENGINE_EVENT_TYPE_UPSERTED:
            return
        self._engines[engine.engine_id] = engine
        if old is not None and (old.incarnation != engine.incarnation or _positions(old) - _positions(engine)):
            self._notify(old, event.reason)

    def _notify(self, engine: reg_pb.Engine, reason: str) -> None:
        for listener in self._listeners:
            try:
                listener(engine.engine_id, engine.incarnation, reason)
            except Exception:  # one faulty listener must not stop the mirror or the others
                logger.exception("removal listener failed for %s", engine.engine_id)
