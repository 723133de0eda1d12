# SPDX-License-Identifier: Apache-2.0
"""The connector's control session against real broker members: BrokerCores with a shard map, each on its own gRPC server.

The members share one in-process RegistrarCore and serve the real
BrokerServicer (WatchShards, EngineReports, the engine streams); their
MapMembership is fed by hand here, as EtcdMembership feeds it from etcd.
The engine reaches the broker at member a's address only: it learns the
map from a's WatchShards, sends each registration to its transfer's owner,
and when b dies and leaves the map, fails the requests b held with
BROKER_SHARD_LOST and keeps their blocks, while new transfers go to a.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry
from rpc_harness import identity_tokens, token_of

from kvpush import errors
from kvpush.clock import SystemClock
from kvpush.dev import sample_engines as sample
from kvpush.rendezvous.v1 import rendezvous_service_pb2_grpc as rv_grpc
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.services.broker import servicer as broker_servicer
from kvpush.services.broker.config import BrokerConfig
from kvpush.services.broker.core import BrokerCore
from kvpush.services.broker.membership import MapMembership
from kvpush.services.common.auth import Authenticator
from kvpush.services.common.config import ServerConfig
from kvpush.services.common.deadline_runner import DeadlineRunner
from kvpush.services.common.server import RunningServer, Service, build_server
from kvpush.services.registrar.config import RegistrarConfig
from kvpush.services.registrar.core import RegistrarCore
from tests.decode_session import decode_session
from tests.sharding import owned
from tests.waiting import eventually

FAST = BrokerConfig(stream_lease_s=0.5, write_timeout_s=0.2, fence_margin_s=0.1, max_clock_skew_s=0.05)


@dataclasses.dataclass
class Member:
    core: BrokerCore
    membership: MapMembership
    running: RunningServer
    runner: asyncio.Task
    lease_held: bool = True  # what its membership's held() says: surely holding its lease

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.running.port}"

    def set_lease(self, held: bool) -> None:
        """Whether the member can be sure of its lease (not during an etcd election, say), told as EtcdMembership tells it."""
        self.lease_held = held
        self.membership.notify()


@contextlib.asynccontextmanager
async def broker_members(member_ids: list[str]) -> AsyncIterator[dict[str, Member]]:
    """One real broker member per id on 127.0.0.1, over one registrar holding prefill-0 and decode-0; every map lists them all."""
    clock = SystemClock()
    registrar = RegistrarCore(RegistrarConfig(default_lease_ttl_s=30.0), clock)
    for engine_id, role in (("prefill-0", sample.PREFILL), ("decode-0", sample.DECODE)):
        for request in sample.engine_requests(engine_id, role):
            registrar.register(request)
    members: dict[str, Member] = {}
    try:
        for member_id in member_ids:
            membership = MapMembership(member_id, lambda m=member_id: members[m].lease_held)
            core = BrokerCore(registrar, FAST, clock, membership=membership)
            service = Service(broker_servicer.SERVICE_NAME, rv_grpc.add_RendezvousServiceServicer_to_server,
                              broker_servicer.BrokerServicer(core, Authenticator(mtls=False)))
            running = await build_server(ServerConfig(listen="127.0.0.1:0"), [service], registry=CollectorRegistry(), tokens=identity_tokens())
            runner = DeadlineRunner(core.tick, clock, f"deadlines {member_id}")
            core.set_wakeup(runner.wake)
            members[member_id] = Member(core, membership, running, asyncio.create_task(runner.run()))
        addresses = {m: member.address for m, member in members.items()}
        for member in members.values():
            member.membership.update(addresses, 1)
        yield members
    finally:
        for member in members.values():
            member.core.close()
            await member.running.stop(0)
            member.runner.cancel()
        await asyncio.gather(*(m.runner for m in members.values()), return_exceptions=True)


async def test_registrations_reach_their_owners_and_a_dead_members_requests_fail_with_their_blocks_held():
    async with broker_members(["a", "b"]) as members:
        with decode_session(members["a"].address, token_of("decode-0"), "test-broker-shards") as decode:
            session, waits, clock, answers, register, drain = decode.session, decode.waits, decode.clock, decode.answers, decode.register, decode.drain
            await eventually(lambda: session.members() == {"a", "b"})
            ab = {"a", "b"}
            (t_a,), (t_b, t_b2) = owned("a", ab, 1), owned("b", ab, 2)
            for transfer_id in (t_a, t_b):
                register(transfer_id)
            await eventually(lambda: len(answers) == 2)
            assert [answers[t][1] for t in (t_a, t_b)] == [None, None]
            assert all(answers[t][0].response.state == tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL for t in (t_a, t_b))
            assert members["a"].core.get_transfer(t_a).state == tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL  # each at its owner
            assert members["b"].core.get_transfer(t_b).state == tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL
            # b dies; a hears it from the coordination store and publishes the map without it.
            await members["b"].running.stop(0)
            members["a"].membership.update({"a": members["a"].address}, 2)
            await eventually(lambda: session.members() == {"a"})
            await asyncio.sleep(0.1)
            drain()
            failed = waits.get(f"d-{t_b}")
            assert failed.member == "b" and failed.failure.startswith("END_REASON_BROKER_SHARD_LOST") and not failed.safe
            assert not waits.get(f"d-{t_a}").failure
            assert waits.due() == ({}, [])  # held until its deadline + hold margin; nothing to cancel at a member that never had it
            register(t_b2)  # hashed to b: now a's
            await eventually(lambda: t_b2 in answers)
            assert answers[t_b2][1] is None and members["a"].core.get_transfer(t_b2).state == tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL
            drain()
            assert waits.get(f"d-{t_b2}").member == "a" and not waits.get(f"d-{t_b2}").failure
            clock.advance(12.0)
            fails, _ = waits.due()
            assert fails[f"d-{t_b}"].startswith("END_REASON_BROKER_SHARD_LOST")


async def test_a_registration_a_member_refused_while_unsure_of_its_lease_reaches_it_once_it_serves_again():
    async with broker_members(["a", "b"]) as members:
        with decode_session(members["a"].address, token_of("decode-0"), "test-broker-shards") as decode:
            session, waits, answers, register, drain = decode.session, decode.waits, decode.answers, decode.register, decode.drain
            await eventually(lambda: session.members() == {"a", "b"})
            (t_b,) = owned("b", {"a", "b"}, 1)
            members["b"].set_lease(False)  # b serves nothing, and refuses what reaches it (UNAVAILABLE BROKER_SHARD_LOST)
            register(t_b)
            await asyncio.sleep(0.4)  # refused and sent again several times meanwhile
            assert t_b not in answers
            members["b"].set_lease(True)  # a new lease, or the old one renewed: b serves again, with the same map
            await eventually(lambda: t_b in answers)
            assert answers[t_b][1] is None, answers[t_b][1]
            assert members["b"].core.get_transfer(t_b).state == tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL
            drain()
            assert waits.get(f"d-{t_b}").member == "b" and not waits.get(f"d-{t_b}").failure


async def test_a_registration_a_member_keeps_refusing_gets_the_refusal_within_the_rpc_timeout():
    async with broker_members(["a", "b"]) as members:
        with decode_session(members["a"].address, token_of("decode-0"), "test-broker-shards") as decode:
            session, answers, register = decode.session, decode.answers, decode.register
            await eventually(lambda: session.members() == {"a", "b"})
            (t_b,) = owned("b", {"a", "b"}, 1)
            members["b"].set_lease(False)
            sent = time.monotonic()
            register(t_b)
            await eventually(lambda: t_b in answers, timeout=5.0)
            error = answers[t_b][1]
            assert isinstance(error, errors.Unavailable) and error.reason == errors.Reason.BROKER_SHARD_LOST, error
            assert time.monotonic() - sent <= decode.session.config.rpc_timeout_s + 0.5

