# SPDX-License-Identifier: Apache-2.0
"""Network partitions of one `kvpush broker --etcd` member, through bench/tcp_proxy.py, between real processes.

A member cut off from the engines but not from etcd keeps its shard lease:
it must notice that no engine reaches it while engines reach another member
and step out of the map, so its transfers move. A member cut off from etcd
but not from the engines stops serving once it cannot renew its lease, and
etcd drops it a lease ttl later.
"""

from __future__ import annotations

import asyncio
import time

import grpc
from sharded_brokers import LEASE_TTL_S, NOT_SERVING, SERVING, T, deployment, map_until, until_health

from bench.tcp_proxy import TcpProxy
from kvpush.dev import sample_engines as sample
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import rendezvous_service_pb2_grpc as rv_grpc
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from tests.sharding import owned_by

SILENCE_S = 1.0
# The first hold-off after a step-down (services/broker/engine_reach.py).
HOLD_OFF_S = 2.0


class EngineStreams:
    """The streams an engine pair keeps to one member, as the connector does: a producer rank's orders, the decode engine's events."""

    def __init__(self, plane, address: str):
        self.channel = grpc.aio.insecure_channel(address)
        stub = rv_grpc.RendezvousServiceStub(self.channel)
        self.calls = [
            stub.StreamWriteOrders(
                rv_pb.StreamWriteOrdersRequest(engine_id="prefill-0", incarnation="inc-1", tp_rank=0, pp_rank=0),
                metadata=plane.bearer("prefill-0"), timeout=60,
            ),
            stub.StreamTransferEvents(
                rv_pb.StreamTransferEventsRequest(engine_id="decode-0", incarnation="inc-1"),
                metadata=plane.bearer("decode-0"), timeout=60,
            ),
        ]

    async def attached(self) -> EngineStreams:
        for call in self.calls:
            await asyncio.wait_for(call.initial_metadata(), T)
        return self

    async def close(self) -> None:
        for call in self.calls:
            call.cancel()
        await self.channel.close()


async def test_a_member_no_engine_reaches_steps_out_and_its_transfers_move(tmp_path, etcd_cluster, etcd_prefix):
    with TcpProxy(("127.0.0.1", 1)) as proxy:
        async with deployment(tmp_path, etcd_cluster.endpoints, etcd_prefix) as plane:
            silence = ("--engine-silence", str(SILENCE_S))
            # Engines reach b2 only through the proxy (it advertises the proxy's address); b2 reaches etcd directly.
            await plane.start_brokers("b1", "b2", args={"b1": silence, "b2": (*silence, "--advertise", proxy.address)})
            proxy.target = ("127.0.0.1", plane.brokers["b2"].port)
            watch = plane.watch("b1")
            addresses = {"b1": plane.brokers["b1"].address, "b2": proxy.address}
            # No engine streams anywhere (a fleet restarting): no member is reached, so none steps down.
            await asyncio.sleep(SILENCE_S * 2)
            assert set((await map_until(watch, lambda m: True))[0]) == {"b1", "b2"}
            streams = [await EngineStreams(plane, addresses[m]).attached() for m in ("b1", "b2")]
            try:
                await asyncio.sleep(SILENCE_S * 2)
                await until_health(plane.brokers["b2"], SERVING, timeout=0.5)  # reached again: it stayed
                moved = owned_by("b2", addresses)
                cut_at = time.monotonic()
                proxy.cut()
                shards_map, _ = await map_until(watch, lambda m: "b2" not in m, timeout=SILENCE_S + 3)
                took = time.monotonic() - cut_at
                assert took < SILENCE_S + 1.0, f"b2 left the map {took:.2f}s after the cut"
                assert shards_map == {"b1": addresses["b1"]}
                assert await until_health(plane.brokers["b2"], NOT_SERVING) < 1.0  # stepped out, still running
                assert plane.brokers["b2"].process.returncode is None
                # b2's transfers are b1's now.
                answer = await plane.stub("b1").RegisterDestination(sample.destination_request(moved), metadata=plane.bearer("decode-0"), timeout=T)
                assert answer.state == tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL
                # Healed: b2 joins again after its hold-off, engines attach again, and it stays.
                await streams.pop().close()
                proxy.heal()
                _, rejoined = await map_until(watch, lambda m: "b2" in m, timeout=HOLD_OFF_S + 3)
                streams.append(await EngineStreams(plane, addresses["b2"]).attached())
                await asyncio.sleep(SILENCE_S * 2)
                assert "b2" in (await map_until(watch, lambda m: True))[0]
                assert await until_health(plane.brokers["b2"], SERVING) < 1.0
                assert rejoined < HOLD_OFF_S + 2
            finally:
                for engine in streams:
                    await engine.close()
                watch.cancel()


async def test_a_member_cut_from_etcd_stops_serving_before_the_others_take_its_transfers(tmp_path, etcd_cluster, etcd_prefix):
    host, port = etcd_cluster.endpoints[0].rsplit(":", 1)
    with TcpProxy((host, int(port))) as proxy:
        async with deployment(tmp_path, etcd_cluster.endpoints, etcd_prefix) as plane:
            await plane.start_brokers("b1", "b2", args={"b2": ("--etcd", proxy.address)})
            watch = plane.watch("b1")
            await map_until(watch, lambda m: set(m) == {"b1", "b2"})
            cut_at = time.monotonic()
            proxy.cut()
            stopped = await until_health(plane.brokers["b2"], NOT_SERVING, timeout=LEASE_TTL_S + 3)
            await map_until(watch, lambda m: "b2" not in m, timeout=LEASE_TTL_S + 3)
            dropped = time.monotonic() - cut_at
            # It stopped serving before its lease could lapse in etcd, so no two members served its transfers at once.
            assert stopped < dropped, (stopped, dropped)
            assert dropped < LEASE_TTL_S + 1.5, f"b2 left the map {dropped:.2f}s after the cut"
            proxy.heal()
            await map_until(watch, lambda m: "b2" in m, timeout=10)
            assert await until_health(plane.brokers["b2"], SERVING) < 5
            watch.cancel()
