# SPDX-License-Identifier: Apache-2.0
"""RemoteEngineDirectory mirrors a registrar over WatchEngines and reports lost ranks, also across a resync."""

from __future__ import annotations

import asyncio

import grpc
from rpc_harness import WAIT_S, FakeEngine, bearer, running_control_plane

from kvpush.dev import sample_engines as sample
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.registrar.v1 import registrar_service_pb2_grpc as reg_grpc
from kvpush.services.broker.remote_directory import RESYNC_REASON, RemoteEngineDirectory
from kvpush.services.common.config import ServerConfig
from kvpush.services.registrar.directory import RemovalReason
from tests.waiting import eventually


async def test_the_mirror_follows_registrations_and_removals():
    async with running_control_plane(ServerConfig(listen="127.0.0.1:0")) as plane:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{plane.port}") as channel:
            prefill = await FakeEngine(channel, "prefill-0", sample.PREFILL).register()
            directory = RemoteEngineDirectory(reg_grpc.RegistrarServiceStub(channel), metadata=bearer("broker"), rpc_timeout_s=WAIT_S)
            removed: list[tuple[str, str, str]] = []
            directory.add_removal_listener(lambda *args: removed.append(args))
            follower = asyncio.create_task(directory.run())
            try:
                await asyncio.wait_for(directory.synced.wait(), WAIT_S)
                assert directory.get_engine("prefill-0").state == reg_pb.ENGINE_STATE_READY

                decode = await FakeEngine(channel, "decode-0", sample.DECODE, tp_size=2).register()
                await eventually(
                    lambda: (
                        directory.get_engine("decode-0") is not None and directory.get_engine("decode-0").state == reg_pb.ENGINE_STATE_READY
                    )
                )
                before = directory.get_engine("decode-0")
                await decode.registrar.DeregisterEngineRank(
                    reg_pb.DeregisterEngineRankRequest(lease_id=decode.leases[1]), metadata=decode.metadata, timeout=WAIT_S
                )
                await eventually(lambda: removed)
                assert removed == [("decode-0", "inc-1", RemovalReason.DEREGISTERED)]
                assert directory.get_engine("decode-0") is not before  # a new snapshot object
                assert directory.get_engine("decode-0").state == reg_pb.ENGINE_STATE_PARTIAL

                # While the mirror is not following, an engine goes away; the resync reports it.
                follower.cancel()
                await asyncio.gather(follower, return_exceptions=True)
                await prefill.registrar.DeregisterEngineRank(
                    reg_pb.DeregisterEngineRankRequest(lease_id=prefill.leases[0]), metadata=prefill.metadata, timeout=WAIT_S
                )
                removed.clear()
                directory.synced.clear()
                follower = asyncio.create_task(directory.run())
                await asyncio.wait_for(directory.synced.wait(), WAIT_S)
                assert removed == [("prefill-0", "inc-1", RESYNC_REASON)]
                assert directory.get_engine("prefill-0") is None
            finally:
                follower.cancel()
                await asyncio.gather(follower, return_exceptions=True)
