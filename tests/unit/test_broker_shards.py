# SPDX-License-Identifier: Apache-2.0
"""BrokerCore as one member of a sharded broker: ownership refusals, moved and lost shards, hand-over grace, the map's watchers."""

from __future__ import annotations

from broker_harness import (
    COMPLETED,
    ENDED,
    FAILED_EVENT,
    FENCE_MARGIN,
    REVOKED,
    STREAM_LEASE,
    WRITE_TIMEOUT,
    D,
    Harness,
    P,
    S,
    expect,
)

from kvpush import errors
from kvpush.dev import sample_engines as sample
from kvpush.errors import Reason
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.services.broker.membership import MapMembership, StaticMembership, shard_map
from tests.sharding import owned_by

ADDRESSES = {"a": "127.0.0.1:1001", "b": "127.0.0.1:1002", "c": "127.0.0.1:1003"}


class HandMembership(MapMembership):
    """A shard map the test changes by hand; this member holds its lease until lose_lease()."""

    def __init__(self, member_id: str, members: dict[str, str]):
        self.held = True
        super().__init__(member_id, lambda: self.held)
        self.update(members, 1)

    def change(self, members: dict[str, str]) -> None:
        self.update(members, self.revision + 1)

    def lose_lease(self, *, tell: bool = True) -> None:
        self.held = False
        if tell:
            self.notify()

    def regain_lease(self) -> None:
        self.held = True
        self.change(dict(self.members()))


def sharded(member: str = "a", members=("a", "b"), **kwargs) -> tuple[Harness, HandMembership]:
    membership = HandMembership(member, {m: ADDRESSES[m] for m in members})
    return Harness(membership=membership, **kwargs), membership


# ----- who serves what -----


def test_the_owner_serves_its_transfers_as_an_unsharded_broker_does():
    h, _ = sharded()
    mine = owned_by("a", "ab")
    h.register(mine)
    h.prefill_done(mine)
    h.write(mine)
    assert h.state(mine) == S.TRANSFER_STATE_DONE and h.events() == [(mine, 1, COMPLETED, S.END_REASON_COMPLETED)]


def test_every_per_transfer_request_for_another_members_transfer_is_refused_naming_the_owner():
    h, _ = sharded()
    theirs = owned_by("b", "ab")
    owner = {"owner_member_id": "b", "owner_address": ADDRESSES["b"]}
    error = expect(errors.FailedPrecondition, Reason.NOT_SHARD_OWNER, "key.transfer_id", h.register, theirs)
    # The owner may accept it: the refusal vouches for nothing, and nothing is remembered here.
    assert error.metadata == {**owner, "field": "key.transfer_id", "fenced": "false"}
    for call in (lambda: h.prefill_done(theirs), lambda: h.write(theirs), lambda: h.cancel(theirs), lambda: h.cancel(theirs, 0)):
        error = expect(errors.FailedPrecondition, Reason.NOT_SHARD_OWNER, "key.transfer_id", call)
        assert error.metadata == {**owner, "field": "key.transfer_id"}
    for attempt in (0, 1):
        expect(errors.FailedPrecondition, Reason.NOT_SHARD_OWNER, "transfer_id", h.broker.get_transfer, theirs, attempt)
    assert h.broker.remembered_attempts == 0 and h.kinds() == [] and h.events() == []
    # A malformed request is refused as before, whoever owns it (no member ever accepts it).
    error = expect(errors.InvalidArgument, Reason.FIELD_INVALID, "key.transfer_id", h.register, "bad id")
    assert error.metadata["fenced"] == "true"


def test_an_unsharded_broker_owns_everything_and_its_map_is_one_shard_at_the_callers_address():
    h = Harness()
    assert h.broker.membership.serving() and h.broker.membership.owner("anything") == ""
    watch = h.broker.watch_shards()
    assert watch.drain() == [rv_pb.WatchShardsResponse(shards=[rv_pb.BrokerShard(member_id="", address="")], revision=0)]
    assert shard_map(StaticMembership()) == rv_pb.WatchShardsResponse(shards=[rv_pb.BrokerShard()])


# ----- a member joins: transfers move away -----


def test_live_attempts_that_move_to_a_new_member_end_shard_moved_and_are_fenced_by_their_answers():
    h, membership = sharded(members=("a",))
    moving = owned_by("c", "ac")
    staying = owned_by("a", "ac", prefix="s")
    for transfer_id in (moving, staying):
        h.register(transfer_id)
        h.prefill_done(transfer_id)
    h.kinds()
    membership.change({m: ADDRESSES[m] for m in "ac"})
    moved = h.broker.get_transfer(moving, 1)  # it still answers about the attempt it holds
    assert (moved.state, moved.end_reason, moved.fenced) == (S.TRANSFER_STATE_FAILED, S.END_REASON_BROKER_SHARD_MOVED, False)
    assert "moved to broker member c" in moved.detail
    assert h.kinds() == [("revocation", moving, 1), ("closed", moving, 1)]
    assert h.events() == [(moving, 1, FAILED_EVENT, S.END_REASON_BROKER_SHARD_MOVED)]
    # The order's answer comes back to the member that sent it, which fences the attempt it holds.
    h.write(moving, outcome=REVOKED)
    assert h.fenced(moving) and h.events() == [(moving, 1, ENDED, S.END_REASON_BROKER_SHARD_MOVED)]
    # A new attempt goes to the new owner; the staying transfer is untouched.
    expect(errors.FailedPrecondition, Reason.NOT_SHARD_OWNER, "key.transfer_id", h.register, moving, 2)
    expect(errors.FailedPrecondition, Reason.NOT_SHARD_OWNER, "transfer_id", h.broker.get_transfer, moving, 0)
    h.write(staying)
    assert h.state(staying) == S.TRANSFER_STATE_DONE


def test_a_moved_attempt_whose_rank_never_answers_is_fenced_by_time():
    h, membership = sharded(members=("a",))
    moving = owned_by("c", "ac")
    h.register(moving)
    h.prefill_done(moving)
    h.kinds()
    h.unsubscribe_producer(0)  # the rank's stream is gone: it acts on nothing past its lease
    quiet = h.clock.now()
    membership.change({m: ADDRESSES[m] for m in "ac"})
    bound = quiet + STREAM_LEASE + WRITE_TIMEOUT + FENCE_MARGIN
    assert h.broker.tick() == bound
    h.advance(bound - h.clock.now() - 0.1)
    assert not h.fenced(moving)
    h.advance(0.1)
    assert h.fenced(moving) and h.events()[-1] == (moving, 1, ENDED, S.END_REASON_BROKER_SHARD_MOVED)


# ----- the member's own lease -----


def test_losing_the_lease_ends_every_live_attempt_shard_lost_and_refuses_everything():
    h, membership = sharded()
    mine = [owned_by("a", "ab", prefix=p) for p in "xyz"]
    h.register(mine[0])
    h.prefill_done(mine[0])
    h.register(mine[1])
    h.prefill_done(mine[2])
    h.kinds()
    watch = h.broker.watch_shards()
    gauge = h.broker.metrics.registry.get_sample_value
    assert (gauge("kvpush_broker_shard_serving"), gauge("kvpush_broker_shard_members")) == (1.0, 2.0)
    membership.lose_lease()
    assert gauge("kvpush_broker_shard_serving") == 0.0
    for transfer_id in mine:
        transfer = h.broker.get_transfer(transfer_id, 1)
        assert (transfer.state, transfer.end_reason) == (S.TRANSFER_STATE_FAILED, S.END_REASON_BROKER_SHARD_LOST)
    assert h.kinds() == [("revocation", mine[0], 1), ("closed", mine[0], 1), ("closed", mine[1], 1), ("closed", mine[2], 1)]
    # The registration that no order names is fenced at once; the ordered one waits for its rank.
    assert h.events() == [(mine[0], 1, FAILED_EVENT, S.END_REASON_BROKER_SHARD_LOST), (mine[1], 1, ENDED, S.END_REASON_BROKER_SHARD_LOST)]
    # New work is refused, and the refusal vouches for nothing.
    error = expect(errors.Unavailable, Reason.BROKER_SHARD_LOST, "", h.register, owned_by("a", "ab", prefix="n"))
    assert error.metadata["fenced"] == "false"
    expect(errors.Unavailable, Reason.BROKER_SHARD_LOST, "", h.cancel, mine[0], 0)
    expect(errors.Unavailable, Reason.BROKER_SHARD_LOST, "", h.broker.watch_shards)
    assert watch.closed  # its map may be stale: the watcher should watch another member
    # Answers to its own orders still fence what it holds.
    h.write(mine[0], outcome=REVOKED)
    assert h.fenced(mine[0]) and h.events() == [(mine[0], 1, ENDED, S.END_REASON_BROKER_SHARD_LOST)]


def test_a_lease_that_lapsed_unannounced_is_acted_on_at_the_next_request():
    h, membership = sharded()
    mine = owned_by("a", "ab")
    h.register(mine)
    membership.lose_lease(tell=False)
    # The attempt ends before the request is answered, and the answer is about the ended attempt it holds.
    error = expect(errors.FailedPrecondition, Reason.TRANSFER_ENDED, "key", h.prefill_done, mine)
    assert "lost its membership" in error.message
    assert h.broker.get_transfer(mine, 1).end_reason == S.END_REASON_BROKER_SHARD_LOST
    expect(errors.Unavailable, Reason.BROKER_SHARD_LOST, "", h.prefill_done, mine, 2)


def test_a_member_answers_about_the_attempts_it_holds_after_they_moved_away():
    h, membership = sharded(members=("a",))
    moving = owned_by("c", "ac")
    h.register(moving)
    membership.change({m: ADDRESSES[m] for m in "ac"})
    # A retried registration gets the recorded answer, not a redirect: the new owner must never take the same blocks too.
    repeat = h.register(moving)
    assert (repeat.state, repeat.fenced) == (S.TRANSFER_STATE_FAILED, True)
    assert h.cancel(moving, 1).state == S.TRANSFER_STATE_FAILED
    expect(errors.FailedPrecondition, Reason.NOT_SHARD_OWNER, "key.transfer_id", h.cancel, moving, 0)
    expect(errors.FailedPrecondition, Reason.NOT_SHARD_OWNER, "key.transfer_id", h.register, moving, 2)


def test_a_member_not_yet_in_the_map_serves_nothing():
    membership = HandMembership("a", {"b": ADDRESSES["b"]})
    h = Harness(membership=membership)
    expect(errors.Unavailable, Reason.BROKER_SHARD_LOST, "", h.register, owned_by("a", "ab"))
    membership.change({m: ADDRESSES[m] for m in "ab"})
    h.register(owned_by("a", "ab"))


# ----- the hand-over grace -----


def test_transfers_gained_from_a_member_that_left_are_vouched_for_only_after_the_grace():
    h, membership = sharded(members=("a", "b"))
    gained, kept = owned_by("b", "ab"), owned_by("a", "ab", prefix="k")
    membership.change({"a": ADDRESSES["a"]})
    # b's orders for a gained transfer may still be acted on: a refusal vouches for nothing yet.
    error = expect(errors.InvalidArgument, Reason.BLOCK_ID_OUT_OF_RANGE, "destination.blocks[0].block_ids[2]", h.register, gained, first_block=998)
    assert error.metadata["fenced"] == "false"
    error = expect(errors.InvalidArgument, Reason.BLOCK_ID_OUT_OF_RANGE, "destination.blocks[0].block_ids[2]", h.register, kept, first_block=998)
    assert error.metadata["fenced"] == "true"
    # Nor is an attempt of it with a destination fenced before the grace ends, even with every answer in.
    grace_end = h.clock.now() + h.config.startup_grace_s
    h.register(gained, 2)
    h.prefill_done(gained, 2)
    h.cancel(gained, 2)
    h.write(gained, 2, outcome=REVOKED)
    assert not h.fenced(gained, 2) and h.broker.tick() == grace_end
    h.advance(grace_end - h.clock.now())
    assert h.fenced(gained, 2)
    error = expect(errors.InvalidArgument, Reason.BLOCK_ID_OUT_OF_RANGE, "destination.blocks[0].block_ids[2]", h.register, gained, 3, first_block=998)
    assert error.metadata["fenced"] == "true"


def test_a_member_that_regains_its_lease_vouches_for_nothing_during_the_grace():
    h, membership = sharded()
    mine = owned_by("a", "ab")
    membership.lose_lease()
    h.clock.advance(1.0)
    membership.regain_lease()
    error = expect(errors.InvalidArgument, Reason.BLOCK_ID_OUT_OF_RANGE, "destination.blocks[0].block_ids[2]", h.register, mine, first_block=998)
    assert error.metadata["fenced"] == "false"
    h.clock.advance(h.config.startup_grace_s)
    error = expect(errors.InvalidArgument, Reason.BLOCK_ID_OUT_OF_RANGE, "destination.blocks[0].block_ids[2]", h.register, mine, first_block=998)
    assert error.metadata["fenced"] == "true"


# ----- the map's watchers -----


def test_watchers_get_the_map_now_and_after_every_change():
    h, membership = sharded()
    watch = h.broker.watch_shards()
    first = watch.drain()
    assert [(s.member_id, s.address) for s in first[0].shards] == [("a", ADDRESSES["a"]), ("b", ADDRESSES["b"])] and first[0].revision == 1
    membership.change({m: ADDRESSES[m] for m in "abc"})
    (second,) = watch.drain()
    assert [s.member_id for s in second.shards] == ["a", "b", "c"] and second.revision == 2
    h.broker.unwatch_shards(watch)
    assert h.broker.memory_sizes["shard_watches"] == 0
    other = h.broker.watch_shards()
    h.broker.close()
    assert other.closed


def test_engine_streams_are_accepted_by_every_member_even_one_not_serving():
    h, membership = sharded(subscribe=False)
    membership.lose_lease()
    h.subscribe_producer(0, early=False)
    h.broker.subscribe_decode(rv_pb.StreamTransferEventsRequest(engine_id=D, incarnation="inc-1"), D)
    request = sample.write_result_request("t1", 1, engine_id=P)
    expect(errors.Unavailable, Reason.BROKER_SHARD_LOST, "", h.broker.report_write_result, request, P)
