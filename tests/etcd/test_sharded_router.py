# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""A push-mode router in front of `kvpush broker --etcd` members (real processes): the member holding an attempt dies, the attempt is retried at the new owner.

The engines are scripted (tests/router's ScriptedEngine) and make their
connector's calls through ShardedBrokerClient with their own tokens.
"""

from __future__ import annotations

import asyncio
import json

from opentelemetry.sdk.trace import TracerProvider
from sharded_brokers import WAIT_S, deployment

from kvpush import errors, shards
from kvpush.client import ClientConfig, ShardedBrokerClient
from kvpush.dev import sample_engines as sample
from kvpush.dev.localstack.scaled import multi_target
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from tests.router.fake_engines import DECODE_WORDS
from tests.router.transfer_failure_harness import BODY, ENDED_STATES, ScriptedEngine, key_of, router_under_test, serve, stop

POLL_S = 5.0


async def attempt_state(client: ShardedBrokerClient, params: dict, wait_s: float | None = None) -> int:
    request = rv_pb.GetTransferRequest(transfer_id=params["transfer_id"], attempt=params["attempt"])
    return (await client.get_transfer(request, wait_s=wait_s)).transfer.state


def decode_connector(client: ShardedBrokerClient, registered: asyncio.Event):
    """Registers the destination at the transfer's owner, waits for the attempt's end; vLLM's error when it failed or the broker is gone."""

    async def script(params: dict) -> str:
        request = sample.destination_request(
            params["transfer_id"], params["attempt"], client_request_id=params["client_request_id"], timeout_s=params["timeout_ms"] / 1000
        )
        try:
            await client.register_destination(request)
            registered.set()
            while (state := await attempt_state(client, params, wait_s=POLL_S)) not in ENDED_STATES:
                pass
        except errors.KvpushError:
            return "vllm-error"
        return "ok" if state == tr_pb.TRANSFER_STATE_DONE else "vllm-error"

    return script


def prefill_connector(client: ShardedBrokerClient, background: set[asyncio.Task]):
    """Attempt 1 never gets to report (its broker member dies first); later attempts report prefill-done and their write."""

    async def write(params: dict) -> None:
        while (state := await attempt_state(client, params)) not in (tr_pb.TRANSFER_STATE_MATCHED, tr_pb.TRANSFER_STATE_WRITING):
            if state in ENDED_STATES:
                return
            await asyncio.sleep(0.02)
        await client.report_write_result(sample.write_result_request(params["transfer_id"], params["attempt"]))

    async def script(params: dict) -> str:
        if params["attempt"] == 1:
            await asyncio.Event().wait()
        request = sample.prefill_done_request(
            params["transfer_id"], params["attempt"], decode_engine_id=params["decode_engine_id"],
            client_request_id=params["client_request_id"], timeout_s=params["timeout_ms"] / 1000,
        )
        await client.report_prefill_done(request)
        task = asyncio.create_task(write(params))
        background.add(task)
        task.add_done_callback(background.discard)
        return "ok"

    return script


async def test_an_attempt_whose_broker_member_died_is_retried_at_the_new_owner(tmp_path, etcd_cluster, etcd_prefix):
    async with deployment(tmp_path, etcd_cluster.endpoints, etcd_prefix) as plane:
        await plane.start_brokers("b1", "b2")
        addresses = {member_id: service.address for member_id, service in plane.brokers.items()}
        seed = multi_target(addresses.values())
        token = plane.token

        registered, background = asyncio.Event(), set()
        decode_client = ShardedBrokerClient(ClientConfig(target=seed, token=token("decode-0")))
        prefill_client = ShardedBrokerClient(ClientConfig(target=seed, token=token("prefill-0")))
        prefill, decode = await serve(
            ScriptedEngine("prefill", "prefill-0", prefill_connector(prefill_client, background)),
            ScriptedEngine("decode", "decode-0", decode_connector(decode_client, registered)),
        )
        try:
            async with router_under_test(0, [prefill], [decode], TracerProvider(), control_plane=seed, token=token("router"), transfer_timeout_ms=20_000) as router:
                shard_map = router.router.broker.shard_map
                assert await shard_map.wait_ready(WAIT_S)
                while shard_map.members() != addresses:
                    await asyncio.sleep(0.02)
                request = asyncio.create_task(router.post("/v1/completions", BODY))
                await asyncio.wait_for(registered.wait(), WAIT_S)
                transfer_id, _ = key_of(decode)
                owner = shards.owner(transfer_id, addresses)
                await plane.brokers[owner].kill()
                status, body, _ = await asyncio.wait_for(request, 3 * WAIT_S)
                metrics = await router.metrics()
        finally:
            await stop(prefill, decode)
            for task in background:
                task.cancel()
            await decode_client.close()
            await prefill_client.close()
    assert status == 200, body
    assert json.loads(body)["choices"][0]["text"] == " ".join(DECODE_WORDS)
    assert [key_of(decode, i) for i in range(len(decode.received))] == [(transfer_id, 1), (transfer_id, 2)]
    assert "kvpush_router_retries_total 1.0" in metrics
    assert 'kvpush_router_leg_failures_total{cause="transfer",leg="decode"} 1.0' in metrics
