# SPDX-License-Identifier: Apache-2.0
"""Leases lapse only by time: a KeepAlive stream that ends (a blip, a second stream) never ends a lease another one renews."""

from __future__ import annotations

import asyncio

import grpc
from rpc_harness import CALL_TIMEOUT_S, FakeEngine, bearer, read, running_control_plane

from kvpush.dev import sample_engines as sample
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.registrar.v1 import registrar_service_pb2_grpc as reg_grpc
from kvpush.services.common.config import ServerConfig
from kvpush.services.registrar.config import RegistrarConfig

TTL_S = 1.0


async def _ready(channel, engine_id: str) -> bool:
    registrar = reg_grpc.RegistrarServiceStub(channel)
    engines = (await registrar.ListEngines(reg_pb.ListEnginesRequest(), metadata=bearer(), timeout=CALL_TIMEOUT_S)).engines
    return any(e.engine_id == engine_id and e.state == reg_pb.ENGINE_STATE_READY for e in engines)


async def test_the_old_streams_end_does_not_end_the_lease_the_new_stream_renews():
    """Defect 6: after a blip two KeepAlive streams renewed one lease, and the old one's cleanup ended it."""
    config = RegistrarConfig(default_lease_ttl_s=TTL_S, min_lease_ttl_s=0.5)
    async with running_control_plane(ServerConfig(listen="127.0.0.1:0"), registrar_config=config) as plane:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{plane.port}") as channel:
            engine = await FakeEngine(channel, "prefill-0", sample.PREFILL).register()
            old = await engine.keep_alive()
            new = await engine.keep_alive()  # the rank reconnected: a second stream on the same lease
            old.cancel()  # the old stream finally ends
            for _ in range(3):  # renew for three TTLs on the new stream only
                await asyncio.sleep(TTL_S / 2)
                await new.write(reg_pb.KeepAliveRequest(lease_ids=engine.leases))
                assert not (await read(new)).unknown_lease_ids
                assert await _ready(channel, "prefill-0")
            new.cancel()


async def test_a_lease_lapses_by_time_once_nothing_renews_it_stream_or_not():
    config = RegistrarConfig(default_lease_ttl_s=TTL_S, min_lease_ttl_s=0.5)
    async with running_control_plane(ServerConfig(listen="127.0.0.1:0"), registrar_config=config) as plane:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{plane.port}") as channel:
            engine = await FakeEngine(channel, "decode-0", sample.DECODE).register()
            stream = await engine.keep_alive()
            stream.cancel()
            assert await _ready(channel, "decode-0")  # a dropped stream alone ends nothing
            await asyncio.sleep(TTL_S * 1.5 + 0.3)
            assert not await _ready(channel, "decode-0")  # its TTL passed without a renewal
