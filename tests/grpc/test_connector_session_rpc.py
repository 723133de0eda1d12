# SPDX-License-Identifier: Apache-2.0
"""The connector's control session against a real control plane: a failing message handler never ends a follower."""

from __future__ import annotations

import asyncio
import threading

import grpc
from rpc_harness import CALL_TIMEOUT_S, FakeEngine, running_control_plane, token_of

from kvpush.connector.config import ConnectorConfig
from kvpush.connector.control import ControlSession
from kvpush.dev import sample_engines as sample
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.services.broker.config import BrokerConfig
from kvpush.services.common.config import ServerConfig

FAST = BrokerConfig(stream_lease_s=0.5, write_timeout_s=0.2, fence_margin_s=0.1, max_clock_skew_s=0.05)


async def test_an_event_handler_that_raises_reopens_the_stream_and_the_event_comes_again():
    """The events follower caught only KvpushError: one unexpected value in a message ended D's event stream for good."""
    async with running_control_plane(ServerConfig(listen="127.0.0.1:0"), broker_config=FAST) as plane:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{plane.port}") as channel:
            await FakeEngine(channel, "prefill-0", sample.PREFILL).register()
            decode = await FakeEngine(channel, "decode-0", sample.DECODE).register()
            await asyncio.sleep(FAST.startup_grace_s)
            config = ConnectorConfig(
                engine_id="decode-0", role="decode", control_plane=f"127.0.0.1:{plane.port}", token=token_of("decode-0")
            )
            session = ControlSession(config, "test-session")
            seen: list[int] = []
            got_twice = threading.Event()

            def handle(message: rv_pb.StreamTransferEventsResponse) -> None:
                seen.append(message.event.type)
                if len(seen) == 1:
                    raise ValueError("an event this engine cannot read")
                got_twice.set()

            request = rv_pb.StreamTransferEventsRequest(engine_id="decode-0", incarnation="inc-1")
            session.follow("StreamTransferEvents", lambda: session.broker.stream_transfer_events(request), handle)
            try:
                await asyncio.sleep(0.3)  # subscribed
                await decode.broker.RegisterDestination(sample.destination_request("t1"), metadata=decode.metadata, timeout=CALL_TIMEOUT_S)
                cancel = rv_pb.CancelTransferRequest(key=tr_pb.TransferKey(transfer_id="t1", attempt=1))
                await decode.broker.CancelTransfer(cancel, metadata=decode.metadata, timeout=CALL_TIMEOUT_S)
                assert await asyncio.to_thread(got_twice.wait, 5.0)
                assert seen == [tr_pb.TRANSFER_EVENT_TYPE_ENDED, tr_pb.TRANSFER_EVENT_TYPE_ENDED]  # the resync sent it again
            finally:
                session.close()
