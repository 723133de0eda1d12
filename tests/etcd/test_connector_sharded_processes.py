# SPDX-License-Identifier: Apache-2.0
"""The connector's control session against `kvpush broker --etcd` members as real processes on a real 3-member etcd.

The decode engine reaches the broker at one member's address, follows the
shard map from it, registers each destination at its transfer's owner, and
when the other member is killed (SIGKILL) and its etcd lease lapses, fails
the requests that member held with BROKER_SHARD_LOST while keeping their
blocks; new transfers then go to the member left.
"""

from __future__ import annotations

import asyncio
import time

from sharded_brokers import WAIT_S, deployment

from kvpush.dev.localstack.scaled import multi_target
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from tests.decode_session import decode_session
from tests.sharding import owned_by
from tests.waiting import eventually


async def test_a_killed_members_waiting_requests_fail_with_broker_shard_lost_and_keep_their_blocks(tmp_path, etcd_cluster, etcd_prefix):
    async with deployment(tmp_path, etcd_cluster.endpoints, etcd_prefix) as plane:
        await plane.start_brokers("b1", "b2")
        with decode_session(plane.brokers["b1"].address, plane.token("decode-0"), "test-sharded-processes") as decode:
            session, waits, clock, answers, register, drain = decode.session, decode.waits, decode.clock, decode.answers, decode.register, decode.drain
            await eventually(lambda: session.members() == {"b1", "b2"})
            both = {"b1", "b2"}
            t1, t2 = owned_by("b1", both), owned_by("b2", both)
            register(t1)
            register(t2)
            await eventually(lambda: len(answers) == 2)
            assert [answers[t][1] for t in (t1, t2)] == [None, None]
            assert {answers[t][0].response.state for t in (t1, t2)} == {tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL}
            await plane.brokers["b2"].kill()
            await eventually(lambda: session.members() == {"b1"}, timeout=WAIT_S)  # b2's lease lapsed; b1's map says so
            await asyncio.sleep(0.1)
            drain()
            lost = waits.get(f"d-{t2}")
            assert lost.member == "b2" and lost.failure.startswith("END_REASON_BROKER_SHARD_LOST") and not lost.safe
            assert not waits.get(f"d-{t1}").failure
            assert waits.due() == ({}, [])  # its blocks wait for its deadline + hold margin
            t3 = owned_by("b2", both, skip=1)  # b2's before: b1's now
            register(t3)
            await eventually(lambda: t3 in answers)
            assert answers[t3][1] is None and answers[t3][0].response.state == tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL
            clock.advance(12.0)
            fails, _ = waits.due()
            assert fails[f"d-{t2}"].startswith("END_REASON_BROKER_SHARD_LOST")


async def test_a_member_restarted_on_its_address_takes_reports_at_once_when_it_rejoins(tmp_path, etcd_cluster, etcd_prefix, caplog):
    """b2 is killed, leaves the map, and rejoins from a new process on the same address: the engine's new stream to it opens on the first try.

    Connections to b2 kept failing meanwhile on the seed's channels (one
    multi-address target of every member); the channel opened for the
    rejoined member has connections of its own, so it neither inherits that
    failure nor waits for their next reconnection attempt.
    """
    async with deployment(tmp_path, etcd_cluster.endpoints, etcd_prefix) as plane:
        await plane.start_brokers("b1", "b2")
        seed = multi_target([plane.brokers[m].address for m in ("b1", "b2")])
        with decode_session(seed, plane.token("decode-0"), "test-sharded-rejoin") as decode:
            session, answers = decode.session, decode.answers
            both = {"b1", "b2"}

            async def answered_in(transfer_id: str, *, rejoining: bool = False) -> float:
                """Registers transfer_id; how long its answer took.

                A member just rejoined may still refuse to serve until it is sure
                of its membership lease: that refusal is its own answer over the
                new stream, which is what is measured here.
                """
                start = time.monotonic()
                decode.register(transfer_id)
                await eventually(lambda: transfer_id in answers)
                error = answers[transfer_id][1]
                assert error is None or (rejoining and "'b2' is not serving" in str(error)), error
                return time.monotonic() - start

            await eventually(lambda: session.members() == both)
            await answered_in(owned_by("b2", both))
            await plane.brokers["b2"].kill()
            await eventually(lambda: session.members() == {"b1"}, timeout=WAIT_S)
            await plane.brokers["b2"].restart()
            await eventually(lambda: session.members() == both, timeout=WAIT_S)
            caplog.clear()
            assert await answered_in(owned_by("b2", both, skip=1), rejoining=True) < 0.5
            assert [r.getMessage() for r in caplog.records if r.name == "kvpush.connector.report_stream"] == []
