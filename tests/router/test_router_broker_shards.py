# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""A push-mode router in front of a sharded broker: an attempt whose broker member left the map fails BROKER_SHARD_LOST and is retried.

The broker members are real grpc.aio servers (tests/client/shard_members)
that publish a shard map the test controls and serve the transfers they
own; the engines are scripted.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from kvpush import shards
from kvpush.client import UNSHARDED, ClientConfig, ShardMap
from kvpush.client.backoff import Backoff
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.services.router.shard_watch import BROKER_SHARD_LOST, BROKER_SHARD_MOVED, Owner, ShardWatch
from tests.client.shard_members import Cluster, Member, members
from tests.router.fake_engines import DECODE_WORDS
from tests.router.transfer_failure_harness import (
    BODY,
    ScriptedEngine,
    answer,
    error_of,
    just,
    key_of,
    router_under_test,
    serve,
    stop,
)
from tests.waiting import eventually

WAIT_S = 5.0


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def hang_on_first_attempt(params: dict):
    """A decode engine whose first attempt never gets its KV (its broker member is about to go)."""
    return answer("hang" if params["attempt"] == 1 else "ok")


async def lose_member_during_first_attempt(spans, **overrides):
    """Runs one request while the only member, m0, leaves the map for m1; returns (status, body, metrics, decode engine, members)."""
    cluster = Cluster()
    async with members(cluster, ["seed", "m0", "m1"]) as served:
        cluster.membership = {"m0": served["m0"].address}
        await cluster.publish(cluster.membership, revision=1)
        prefill, decode = await serve(ScriptedEngine("prefill", "prefill-0", just("ok")), ScriptedEngine("decode", "decode-0", hang_on_first_attempt))
        try:
            async with router_under_test(port_of(served["seed"].address), [prefill], [decode], spans[0], **overrides) as router:
                assert await router.router.broker.shard_map.wait_ready(WAIT_S)
                request = asyncio.create_task(router.post("/v1/completions", BODY))
                await eventually(lambda: len(decode.received) == 1)
                cluster.membership = {"m1": served["m1"].address}
                await cluster.publish(cluster.membership, revision=2)
                status, body, _ = await request
                metrics = await router.metrics()
                await eventually(lambda: decode.disconnected == 1)
        finally:
            await stop(prefill, decode)
    return status, body, metrics, decode, served


async def test_an_attempt_whose_broker_member_left_is_retried_at_the_new_owner(spans):
    status, body, metrics, decode, served = await lose_member_during_first_attempt(spans)
    assert status == 200, body
    assert json.loads(body)["choices"][0]["text"] == " ".join(DECODE_WORDS)
    transfer_id, _ = key_of(decode)
    assert [key_of(decode, i) for i in range(2)] == [(transfer_id, 1), (transfer_id, 2)], "the same engines, attempt + 1"
    assert decode.disconnected == 1, "the first attempt's decode leg was closed"
    assert ("CancelTransfer", transfer_id) in served["m1"].calls, "the lost attempt is cancelled at the transfer's new owner"
    assert "kvpush_router_retries_total 1.0" in metrics
    assert 'kvpush_router_leg_failures_total{cause="transfer",leg="decode"} 1.0' in metrics
    assert 'kvpush_router_failed_requests_total{reason="BROKER_SHARD_LOST"} 0.0' in metrics


async def test_a_lost_broker_member_answers_503_when_no_attempt_is_left(spans):
    status, body, metrics, decode, served = await lose_member_during_first_attempt(spans, max_attempts=1)
    error = error_of(body)
    transfer_id, _ = key_of(decode)
    assert status == 503 and error["type"] == "ServiceUnavailableError"
    assert (error["reason"], error["leg"], error["transfer_id"], error["attempt"]) == ("BROKER_SHARD_LOST", "decode", transfer_id, 1)
    assert f"transfer {transfer_id} attempt 1: broker member m0 ({served['m0'].address}) left the broker's shard map" in error["message"]
    assert 'kvpush_router_failed_requests_total{reason="BROKER_SHARD_LOST"} 1.0' in metrics


async def test_a_member_leaving_after_the_kv_arrived_changes_nothing(spans):
    provider, exporter = spans
    cluster = Cluster()
    release = asyncio.Event()

    async def decode_after_release(params: dict) -> str:
        await release.wait()
        return "ok"

    async with members(cluster, ["seed", "m0", "m1"]) as served:
        cluster.membership = {"m0": served["m0"].address}
        served["m0"].transfer_state = tr_pb.TRANSFER_STATE_DONE
        await cluster.publish(cluster.membership, revision=1)
        prefill, decode = await serve(ScriptedEngine("prefill", "prefill-0", just("ok")), ScriptedEngine("decode", "decode-0", decode_after_release))
        try:
            async with router_under_test(port_of(served["seed"].address), [prefill], [decode], provider, early_poll_delay_s=0.05) as router:
                assert await router.router.broker.shard_map.wait_ready(WAIT_S)
                request = asyncio.create_task(router.post("/v1/completions", BODY))
                # The router has m0's DONE answer (its poll's span ended), not just m0 the call.
                await eventually(lambda: any(span.name == "kvpush.rpc/GetTransfer" for span in exporter.get_finished_spans()))
                cluster.membership = {"m1": served["m1"].address}
                await cluster.publish(cluster.membership, revision=2)
                await eventually(lambda: router.router.broker.shard_map.revision == 2)
                await asyncio.sleep(0.1)
                release.set()
                status, body, _ = await request
        finally:
            await stop(prefill, decode)
    transfer_id, _ = key_of(decode)
    assert status == 200, body
    assert len(decode.received) == 1 and decode.disconnected == 0
    assert ("CancelTransfer", transfer_id) not in served["m1"].calls


async def test_shard_watch_tells_a_lost_owner_from_a_moved_transfer():
    cluster = Cluster()
    async with members(cluster, ["m0", "m1"]) as served:
        a0, a1 = served["m0"].address, served["m1"].address
        await cluster.publish({"m0": a0}, revision=1)
        shard_map = ShardMap(ClientConfig(target=a0), backoff=Backoff(0.01, 0.05))
        watch = ShardWatch(shard_map)
        try:
            assert watch.lost("t", Owner()) == "", "an unsharded owner is never lost"
            assert await shard_map.wait_ready(WAIT_S)
            moving = next(t for t in (f"t-{n}" for n in range(100)) if shards.owner(t, {"m0": a0, "m1": a1}) == "m1")
            staying = next(t for t in (f"t-{n}" for n in range(100)) if shards.owner(t, {"m0": a0, "m1": a1}) == "m0")
            assert watch.owner(moving) == Owner("m0", a0)
            moved, stayed, unsharded = watch.watch(moving, Owner("m0", a0)), watch.watch(staying, Owner("m0", a0)), watch.watch(moving, Owner())
            await cluster.publish({"m0": a0, "m1": a1}, revision=2)
            assert await asyncio.wait_for(moved, WAIT_S) == BROKER_SHARD_MOVED
            assert not stayed.done() and not unsharded.done()
            await cluster.publish({"m0": a1}, revision=3)  # m0 came back at another address: what it held is gone
            assert await asyncio.wait_for(stayed, WAIT_S) == BROKER_SHARD_LOST
            assert watch.watch(staying, Owner("m0", a0)).result() == BROKER_SHARD_LOST, "already lost: resolved at once"
            watch.unwatch(unsharded)
            assert unsharded.cancelled()
            assert watch.lost("t", Owner(UNSHARDED, a0)) == ""
        finally:
            watch.close()
            await shard_map.close()


async def test_the_embedded_control_plane_is_one_unsharded_shard(plane, spans):
    prefill, decode = await serve(ScriptedEngine("prefill", "prefill-0", just("ok")), ScriptedEngine("decode", "decode-0", just("ok")))
    try:
        async with router_under_test(plane.port, [prefill], [decode], spans[0]) as router:
            shard_map = router.router.broker.shard_map
            assert await shard_map.wait_ready(WAIT_S)
            assert (shard_map.sharded, shard_map.members()) == (False, {UNSHARDED: f"127.0.0.1:{plane.port}"})
            assert router.router.shards.owner("xfer-1") == Owner(UNSHARDED, f"127.0.0.1:{plane.port}")
    finally:
        await stop(prefill, decode)


@pytest.mark.parametrize("decode_outcome", ["hang", "vllm-error"])
async def test_an_unreachable_member_still_in_the_map_is_answered_by_the_requests_deadline(spans, decode_outcome):
    """The attempt's member stops answering but its lease has not lapsed (the map still lists it), and the decode leg stays
    silent or fails (the router asks the broker why at the transfer deadline, or at once): the router waits for the
    map to drop it only until the request's own bound (its transfer deadline plus slack), not --shard-loss-wait, and names
    the member; it does not cancel the attempt at a member that does not answer (that would add the call's timeout)."""
    transfer_timeout_ms, slack_s, shard_loss_wait_s = 600, 0.2, 5.0
    cluster = Cluster()
    async with members(cluster, ["seed", "m0"]) as served:
        cluster.membership = {"m0": served["m0"].address}
        await cluster.publish(cluster.membership, revision=1)
        prefill, decode = await serve(ScriptedEngine("prefill", "prefill-0", just("ok")), ScriptedEngine("decode", "decode-0", just(decode_outcome)))
        overrides = {"transfer_timeout_ms": transfer_timeout_ms, "transfer_deadline_slack_s": slack_s, "shard_loss_wait_s": shard_loss_wait_s}
        try:
            async with router_under_test(port_of(served["seed"].address), [prefill], [decode], spans[0], **overrides) as router:
                assert await router.router.broker.shard_map.wait_ready(WAIT_S)
                await served["m0"].server.stop(grace=None)  # dead, still listed: its lease has not lapsed
                loop = asyncio.get_running_loop()
                started = loop.time()
                status, body, _ = await router.post("/v1/completions", BODY)
                elapsed = loop.time() - started
                metrics = await router.metrics()
        finally:
            await stop(prefill, decode)
    error = error_of(body)
    assert status == 503 and error["reason"] == "BROKER_MEMBER_UNREACHABLE", body
    assert f"broker member m0 ({served['m0'].address}) did not answer" in error["message"], error["message"]
    assert "had not left the broker's shard map" in error["message"]
    guard_s = transfer_timeout_ms / 1000 + slack_s  # then the broker gets half the slack again to say why
    assert guard_s <= elapsed < guard_s + slack_s / 2 + 0.5 < shard_loss_wait_s, f"answered after {elapsed:.2f} s"
    assert 'kvpush_router_failed_requests_total{reason="BROKER_MEMBER_UNREACHABLE"} 1.0' in metrics
    assert "kvpush_router_cancel_failures_total 0.0" in metrics, "no cancel was sent to the member that did not answer"


class StalledBroker(Member):
    """An unsharded broker that stops answering GetTransfer and CancelTransfer once stalled (its port still accepts calls)."""

    stalled = False

    async def GetTransfer(self, request, context):
        if self.stalled:
            self.calls.append(("GetTransfer", request.transfer_id))
            await asyncio.Event().wait()  # until the caller's deadline cancels the call
        return await super().GetTransfer(request, context)

    async def CancelTransfer(self, request, context):
        if self.stalled:
            self.calls.append(("CancelTransfer", request.key.transfer_id))
            await asyncio.Event().wait()
        return await super().CancelTransfer(request, context)


async def test_a_stalled_unsharded_broker_does_not_hold_up_the_answer_with_the_attempts_cancel(spans):
    """The decode leg stays silent and the only broker stops answering: the request is answered at its transfer deadline plus
    slack (plus half the slack the broker gets to say why), not --cancel-timeout later; the attempt's cancel is still sent,
    beside the answer, and fails on its own bound."""
    transfer_timeout_ms, slack_s, cancel_timeout_s = 600, 0.2, 2.0
    cluster = Cluster()  # publishes revision 0: unsharded
    async with members(cluster, ["broker"], member_class=StalledBroker) as served:
        broker = served["broker"]
        prefill, decode = await serve(ScriptedEngine("prefill", "prefill-0", just("ok")), ScriptedEngine("decode", "decode-0", just("hang")))
        overrides = {"transfer_timeout_ms": transfer_timeout_ms, "transfer_deadline_slack_s": slack_s, "cancel_timeout_s": cancel_timeout_s}
        try:
            async with router_under_test(port_of(broker.address), [prefill], [decode], spans[0], **overrides) as router:
                assert await router.router.broker.shard_map.wait_ready(WAIT_S)
                assert not router.router.broker.shard_map.sharded
                broker.stalled = True
                loop = asyncio.get_running_loop()
                started = loop.time()
                status, body, _ = await router.post("/v1/completions", BODY)
                elapsed = loop.time() - started
                transfer_id, _ = key_of(decode)
                await eventually(lambda: ("CancelTransfer", transfer_id) in broker.calls)
                answered_metrics = await router.metrics()
                for _ in range(int((cancel_timeout_s + 2) / 0.05)):
                    metrics = await router.metrics()
                    if "kvpush_router_cancel_failures_total 1.0" in metrics:
                        break
                    await asyncio.sleep(0.05)
        finally:
            await stop(prefill, decode)
    error = error_of(body)
    assert status == 504 and error["reason"] == "ROUTER_DEADLINE_EXCEEDED", body
    assert "the kvpush control plane could not say why" in error["message"], error["message"]
    guard_s = transfer_timeout_ms / 1000 + slack_s
    assert guard_s <= elapsed < guard_s + slack_s / 2 + 0.5 < guard_s + cancel_timeout_s, f"answered after {elapsed:.2f} s"
    assert "kvpush_router_cancel_failures_total 0.0" in answered_metrics, "the cancel was still running when the request was answered"
    assert "kvpush_router_cancel_failures_total 1.0" in metrics, "the cancel ended on its own bound"
