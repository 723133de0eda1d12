# SPDX-License-Identifier: Apache-2.0
"""EngineReports: an engine's per-request messages in batches on one stream, against a real control plane.

Each item is applied exactly as its unary call would be and answered on the
stream in order; a refused item gets its status and the stream goes on; the
stream itself is authorized once, for the engine it names. The connector's
ReportStream resends and times out items like a unary call's retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading

import grpc
from rpc_harness import STREAM_TIMEOUT_S, WAIT_S, FakeEngine, expect_rpc_error, read, running_control_plane, token_of

from kvpush import errors
from kvpush.client import BrokerClient, ClientConfig, LoopThread
from kvpush.connector.report_stream import Report, ReportStream
from kvpush.dev import sample_engines as sample
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.services.broker.config import BrokerConfig
from kvpush.services.common.config import ServerConfig

FAST = BrokerConfig(stream_lease_s=0.5, write_timeout_s=0.2, fence_margin_s=0.1, max_clock_skew_s=0.05)


async def engines(channel) -> tuple[FakeEngine, FakeEngine]:
    prefill = await FakeEngine(channel, "prefill-0", sample.PREFILL).register()
    decode = await FakeEngine(channel, "decode-0", sample.DECODE).register()
    await asyncio.sleep(FAST.startup_grace_s)
    return prefill, decode


@contextlib.asynccontextmanager
async def plane_with_engines():
    """A control plane with prefill-0 and decode-0 registered: (port, prefill, decode)."""
    async with running_control_plane(ServerConfig(listen="127.0.0.1:0"), broker_config=FAST) as plane:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{plane.port}") as channel:
            prefill, decode = await engines(channel)
            yield plane.port, prefill, decode


def reports(engine: FakeEngine):
    return engine.broker.EngineReports(metadata=engine.metadata, timeout=STREAM_TIMEOUT_S)


async def test_a_batch_is_applied_item_by_item_and_answered_in_order():
    async with plane_with_engines() as (_, prefill, decode):
        d_stream, p_stream = reports(decode), reports(prefill)
        batch = rv_pb.EngineReportsRequest(engine_id="decode-0", registrations=[sample.destination_request("t1"), sample.destination_request("t2")],
                                           cancels=[rv_pb.CancelTransferRequest(key=tr_pb.TransferKey(transfer_id="t2", attempt=1))])
        await d_stream.write(batch)
        answer = await read(d_stream)
        assert [a.key.transfer_id for a in answer.registrations] == ["t1", "t2"]
        assert all(a.response.state == tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL for a in answer.registrations)
        assert answer.cancels[0].response.state == tr_pb.TRANSFER_STATE_CANCELLED
        # P's prefill-done and write result on its own stream complete t1 as the unary calls would.
        await p_stream.write(rv_pb.EngineReportsRequest(engine_id="prefill-0", prefill_done=[sample.prefill_done_request("t1")]))
        assert (await read(p_stream)).prefill_done[0].state == tr_pb.TRANSFER_STATE_MATCHED
        await p_stream.write(rv_pb.EngineReportsRequest(engine_id="prefill-0", write_results=[sample.write_result_request("t1")]))
        assert (await read(p_stream)).write_results[0].state == tr_pb.TRANSFER_STATE_DONE
        got = await decode.broker.GetTransfer(rv_pb.GetTransferRequest(transfer_id="t1"), metadata=decode.metadata, timeout=WAIT_S)
        assert got.transfer.state == tr_pb.TRANSFER_STATE_DONE
        d_stream.cancel()
        p_stream.cancel()


async def test_a_refused_item_gets_its_status_and_the_stream_goes_on():
    async with plane_with_engines() as (_, _, decode):
        stream = reports(decode)
        other = sample.destination_request("t1", decode_engine_id="decode-1")  # another engine's blocks
        malformed = sample.destination_request("t2")
        malformed.timeout.Clear()
        await stream.write(rv_pb.EngineReportsRequest(engine_id="decode-0", registrations=[other, malformed, sample.destination_request("t3")]))
        refused, invalid, accepted = (await read(stream)).registrations
        assert (refused.error.code, refused.error.reason, refused.error.metadata["field"]) == (
            "PERMISSION_DENIED", "ENGINE_IDENTITY_MISMATCH", "destination.engine_id")
        assert invalid.error.code == "INVALID_ARGUMENT" and invalid.error.metadata["field"] == "timeout"
        assert accepted.response.state == tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL
        await stream.write(rv_pb.EngineReportsRequest(engine_id="decode-0", registrations=[sample.destination_request("t4")]))
        assert (await read(stream)).registrations[0].response.state == tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL
        stream.cancel()


async def test_the_stream_acts_only_for_the_callers_own_engine():
    async with plane_with_engines() as (_, _, decode):
        stream = reports(decode)
        await stream.write(rv_pb.EngineReportsRequest(engine_id="decode-1"))
        await expect_rpc_error(stream.read(), grpc.StatusCode.PERMISSION_DENIED, "ENGINE_IDENTITY_MISMATCH", "engine_id")
        stream = reports(decode)
        await stream.write(rv_pb.EngineReportsRequest(engine_id="decode-0"))
        await read(stream)
        await stream.write(rv_pb.EngineReportsRequest(engine_id="prefill-0"))
        await expect_rpc_error(stream.read(), grpc.StatusCode.INVALID_ARGUMENT, "FIELD_INVALID", "engine_id")


class Answers:
    """Collects ReportStream answers from the control loop."""

    def __init__(self, expected: int):
        self.items: list[tuple[object, errors.KvpushError | None]] = []
        self.expected = expected
        self.done = threading.Event()

    def __call__(self, answer, error) -> None:
        self.items.append((answer, error))
        if len(self.items) >= self.expected:
            self.done.set()


def report_stream(target: str, engine_id: str, timeout_s: float = 5.0) -> tuple[ReportStream, LoopThread, BrokerClient]:
    loop = LoopThread("test-reports")
    broker = BrokerClient(ClientConfig(target=target, token=token_of(engine_id), default_timeout_s=timeout_s))
    stream = ReportStream(broker, engine_id, loop.loop, timeout_s, lambda: False)
    loop.submit(stream.run())
    return stream, loop, broker


async def test_the_connectors_report_stream_sends_batches_and_hands_each_answer_back():
    async with plane_with_engines() as (port, _, _):
        stream, loop, broker = report_stream(f"127.0.0.1:{port}", "decode-0")
        try:
            answers = Answers(3)
            prepared = []
            stream.send_many([Report("registrations", sample.destination_request(f"t{i}"), answers, prepare=lambda i=i: prepared.append(i))
                              for i in range(2)] + [Report("registrations", sample.destination_request("t0", decode_engine_id="decode-1"), answers)])
            assert await asyncio.to_thread(answers.done.wait, WAIT_S)
            assert prepared == [0, 1]
            (a0, e0), (a1, e1), (a2, e2) = answers.items
            assert e0 is None and e1 is None and a0.response.state == a1.response.state == tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL
            assert a2 is None and isinstance(e2, errors.PermissionDenied) and e2.reason == "ENGINE_IDENTITY_MISMATCH"
        finally:
            loop.call(broker.close(0.1), timeout_s=2.0)
            loop.stop()


async def test_a_stream_whose_items_were_all_answered_stays_open_while_quiet(caplog):
    """Quiet for longer than the timeout after its answers came, the stream is not taken for stalled: no reopening, no warning."""
    async with plane_with_engines() as (port, _, _):
        stream, loop, broker = report_stream(f"127.0.0.1:{port}", "decode-0", timeout_s=0.5)
        try:
            first, second = Answers(1), Answers(1)
            stream.send(Report("registrations", sample.destination_request("t1"), first))
            assert await asyncio.to_thread(first.done.wait, WAIT_S) and first.items[0][1] is None
            await asyncio.sleep(1.5)  # three timeouts with nothing in flight
            stream.send(Report("registrations", sample.destination_request("t2"), second))
            assert await asyncio.to_thread(second.done.wait, WAIT_S) and second.items[0][1] is None
            assert [r.getMessage() for r in caplog.records if r.name == "kvpush.connector.report_stream"] == []
        finally:
            loop.call(broker.close(0.1), timeout_s=2.0)
            loop.stop()


async def test_an_item_with_no_answer_within_the_timeout_is_answered_deadline_exceeded():
    """Nothing listens: the stream cannot open, and the item ends as a unary call's deadline would end it."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        stream, loop, broker = report_stream(f"127.0.0.1:{closed.getsockname()[1]}", "decode-0", timeout_s=0.5)
        try:
            answers = Answers(1)
            stream.send(Report("registrations", sample.destination_request("t1"), answers))
            assert await asyncio.to_thread(answers.done.wait, WAIT_S)
            ((answer, error),) = answers.items
            assert answer is None and isinstance(error, errors.DeadlineExceeded)
        finally:
            loop.call(broker.close(0.1), timeout_s=2.0)
            loop.stop()


async def test_an_item_moved_from_another_members_stream_is_answered_at_its_own_expiry():
    """Queued behind items that expire later (it kept its expiry when it moved), it still gets DeadlineExceeded at its own."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        stream, loop, broker = report_stream(f"127.0.0.1:{closed.getsockname()[1]}", "decode-0", timeout_s=5.0)
        try:
            later, moved = Answers(1), Answers(1)
            stream.send(Report("registrations", sample.destination_request("t1"), later))
            await asyncio.sleep(0.1)
            item = Report("registrations", sample.destination_request("t2"), moved, expires=loop.loop.time() + 0.3)
            loop.loop.call_soon_threadsafe(stream.put, [item])
            assert await asyncio.to_thread(moved.done.wait, 2.0)
            assert isinstance(moved.items[0][1], errors.DeadlineExceeded) and not later.done.is_set()
        finally:
            loop.call(broker.close(0.1), timeout_s=2.0)
            loop.stop()
