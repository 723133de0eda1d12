# SPDX-License-Identifier: Apache-2.0
"""Random interleavings of everything that can happen to transfers; the broker's invariants hold after every step.

Invariants:
* at most one write order per (transfer, attempt, producer rank);
* only the newest attempt of a transfer is live (a newer one supersedes);
* no order for an attempt that had already ended (superseded, cancelled, failed);
* an attempt whose deadline passed is terminal;
* an ended attempt is fenced exactly when every ordered rank answered or was lost;
* the decode side hears ENDED only once every ordered rank answered or was lost;
* every settled attempt told both sides: the decode engine (if it registered
  and is still alive) got its TransferEvent, every live rank of the prefill
  engine got TransferClosed.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpush import errors
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.services.broker.config import BrokerConfig
from kvpush.services.broker.core import Actor, BrokerCore
from kvpush.services.common import sample_engines as sample
from kvpush.services.common.clock import ManualClock
from kvpush.services.common.engine_tokens import EngineTokens, generate_key
from kvpush.services.registrar.config import RegistrarConfig
from kvpush.services.registrar.core import RegistrarCore, RemovalReason

P, D = "prefill-0", "decode-0"
P_TP = 2
TRANSFERS = ("t0", "t1", "t2")
TERMINAL = {tr_pb.TRANSFER_STATE_DONE, tr_pb.TRANSFER_STATE_FAILED, tr_pb.TRANSFER_STATE_CANCELLED, tr_pb.TRANSFER_STATE_SUPERSEDED}
OUTCOMES = (tr_pb.WRITE_OUTCOME_WRITTEN, tr_pb.WRITE_OUTCOME_FAILED, tr_pb.WRITE_OUTCOME_REVOKED)

transfer_ids = st.sampled_from(TRANSFERS)
attempts = st.integers(min_value=1, max_value=3)
timeouts = st.sampled_from((1.0, 4.0, 20.0))
token_counts = st.sampled_from((16, 40, 48))


class BrokerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.clock = ManualClock()
        self.registrar = RegistrarCore(RegistrarConfig(default_lease_ttl_s=1000.0, max_lease_ttl_s=1000.0), self.clock, EngineTokens(generate_key()))
        self.broker = BrokerCore(self.registrar, BrokerConfig(retention_s=1e6), self.clock)
        self.incarnations = {P: 0, D: 0}
        self.leases: dict[str, list[str]] = {}
        self.subscriptions: list = []  # every producer subscription ever made: (rank key, Subscription)
        self.decode_subscriptions: list = []
        self.lost: set[tuple[str, str, int]] = set()  # (engine, incarnation, tp) whose lease ended
        self.ordered: dict[tuple[str, int], set[tuple[str, str, int]]] = {}
        self.revoked: set[tuple[str, int, tuple[str, str, int]]] = set()
        self.answered: dict[tuple[str, int], set[tuple[str, str, int]]] = {}
        self.closed: dict[tuple[str, int], set[tuple[str, str, int]]] = {}
        self.decode_told: dict[tuple[str, int], list[int]] = {}
        self.ended_before_step: set[tuple[str, int]] = set()
        self.touched: set[tuple[str, int]] = set()
        self._start(P)
        self._start(D)

    # ----- engines -----

    def _incarnation(self, engine_id: str) -> str:
        return f"inc-{self.incarnations[engine_id]}"

    def _start(self, engine_id: str) -> None:
        self.incarnations[engine_id] += 1
        incarnation = self._incarnation(engine_id)
        role, tp = (sample.PREFILL, P_TP) if engine_id == P else (sample.DECODE, 1)
        self.leases[engine_id] = [self.registrar.register(r).lease_id for r in sample.engine_requests(engine_id, role, tp_size=tp, incarnation=incarnation)]
        if engine_id == P:
            for tp_rank in range(P_TP):
                # Rank 0 asks for early orders, rank 1 does not.
                request = rv_pb.StreamWriteOrdersRequest(engine_id=P, incarnation=incarnation, tp_rank=tp_rank, early_orders=tp_rank == 0)
                self.subscriptions.append(((P, incarnation, tp_rank), self.broker.subscribe_producer(request, P)))
        else:
            request = rv_pb.StreamTransferEventsRequest(engine_id=D, incarnation=incarnation)
            self.decode_subscriptions.append(self.broker.subscribe_decode(request, D))

    def _call(self, fn, *args) -> None:
        """Runs a broker call; refusals (kvpush errors) are part of the game, anything else fails the test."""
        try:
            fn(*args)
        except errors.KvpushError:
            pass

    # ----- rules -----

    @rule(transfer_id=transfer_ids, attempt=attempts, timeout=timeouts, tokens=token_counts, early_block=st.integers(0, 3))
    def register_destination(self, transfer_id, attempt, timeout, tokens, early_block):
        self.touched.add((transfer_id, attempt))
        request = sample.destination_request(
            transfer_id, attempt, incarnation=self._incarnation(D), num_tokens=min(tokens, 40), timeout_s=timeout, first_block=early_block
        )
        self._call(self.broker.register_destination, request, D)

    @rule(transfer_id=transfer_ids, attempt=attempts, timeout=timeouts, tokens=token_counts, name_decode=st.booleans())
    def report_prefill_done(self, transfer_id, attempt, timeout, tokens, name_decode):
        self.touched.add((transfer_id, attempt))
        request = sample.prefill_done_request(
            transfer_id, attempt, incarnation=self._incarnation(P), num_tokens=tokens, timeout_s=timeout, decode_engine_id=D if name_decode else ""
        )
        self._call(self.broker.report_prefill_done, request, P)

    @rule(transfer_id=transfer_ids, attempt=st.integers(0, 3), actor=st.sampled_from(list(Actor)))
    def cancel(self, transfer_id, attempt, actor):
        caller = {Actor.ROUTER: "", Actor.PREFILL: P, Actor.DECODE: D}[actor]
        if attempt:
            self.touched.add((transfer_id, attempt))
        self._call(self.broker.cancel, tr_pb.TransferKey(transfer_id=transfer_id, attempt=attempt), actor, "", caller)

    @rule(seconds=st.sampled_from((0.5, 1.0, 3.0, 10.0)))
    def advance_clock(self, seconds):
        self.clock.advance(seconds)
        self.broker.tick()

    @rule(data=st.data())
    def answer_an_order(self, data):
        pending = sorted(
            (key, rank)
            for key, ranks in self.ordered.items()
            for rank in ranks
            if rank not in self.answered.get(key, set()) and rank not in self.lost
        )
        if not pending:
            return
        key, rank = data.draw(st.sampled_from(pending))
        outcome = data.draw(st.sampled_from(OUTCOMES))
        request = sample.write_result_request(key[0], key[1], tp_rank=rank[2], outcome=outcome)
        self.broker.report_write_result(request, P)  # an answer to a real order is never refused
        self.answered.setdefault(key, set()).add(rank)

    @rule(engine_id=st.sampled_from((P, D)), reason=st.sampled_from((RemovalReason.LEASE_EXPIRED, RemovalReason.KEEPALIVE_STREAM_CLOSED)))
    def lose_engine_and_restart_it(self, engine_id, reason):
        incarnation = self._incarnation(engine_id)
        tp = P_TP if engine_id == P else 1
        self.lost.update((engine_id, incarnation, r) for r in range(tp))
        self.registrar.end_leases(self.leases[engine_id], reason)
        self._start(engine_id)

    @rule(engine_id=st.sampled_from((P, D)))
    def restart_with_a_new_incarnation(self, engine_id):
        tp = P_TP if engine_id == P else 1
        self.lost.update((engine_id, self._incarnation(engine_id), r) for r in range(tp))
        self._start(engine_id)

    # ----- observation and invariants -----

    def _state(self, key):
        record = self.broker._transfers.get(key[0])
        return record.attempts.get(key[1]) if record is not None else None

    @invariant()
    def invariants_hold(self):
        # Outputs first: the attempt states checked next must account for
        # everything this step emitted.
        self._observe_outputs()
        self._check_attempts()

    def _observe_outputs(self):
        for rank, subscription in self.subscriptions:
            for message in subscription.outbox.drain():
                kind = message.WhichOneof("message")
                body = getattr(message, kind)
                key = (body.key.transfer_id, body.key.attempt)
                if kind == "order":
                    assert key not in self.ended_before_step, f"order for {key}, which had already ended"
                    assert (key, rank) not in self.revoked, f"order for {key} after its revocation"
                    ranks = self.ordered.setdefault(key, set())
                    assert rank not in ranks, f"second order for {key} to {rank}"
                    ranks.add(rank)
                elif kind == "revocation":
                    self.revoked.add((key, rank))
                else:
                    self.closed.setdefault(key, set()).add(rank)
        for subscription in self.decode_subscriptions:
            for message in subscription.outbox.drain():
                event = message.event
                key = (event.key.transfer_id, event.key.attempt)
                self.decode_told.setdefault(key, []).append(event.type)
                if event.type == tr_pb.TRANSFER_EVENT_TYPE_ENDED:
                    unanswered = self.ordered.get(key, set()) - self.answered.get(key, set()) - self.lost
                    assert not unanswered, f"decode told {key} ended while {unanswered} may still write"

    def _check_attempts(self):
        now = self.clock.now()
        for key in self.touched:
            att = self._state(key)
            if att is None:
                continue
            if att.state not in TERMINAL:
                assert now < att.deadline, f"{key} is live past its deadline"
                newest = max(self.broker._transfers[key[0]].attempts)
                assert key[1] == newest, f"{key} is live beside newer attempt {newest}"
                continue
            self.ended_before_step.add(key)
            unanswered = self.ordered.get(key, set()) - self.answered.get(key, set()) - self.lost
            assert att.fenced == (not unanswered), f"{key} fenced={att.fenced} with unanswered {unanswered}"
            if not att.fenced:
                continue
            told = self.decode_told.get(key, [])
            assert len(told) <= 1, f"decode told {key} twice: {told}"
            decode_alive = (D, att.d_incarnation, 0) not in self.lost
            if att.dest is not None and decode_alive:
                expected = tr_pb.TRANSFER_EVENT_TYPE_COMPLETED if att.state == tr_pb.TRANSFER_STATE_DONE else tr_pb.TRANSFER_EVENT_TYPE_ENDED
                assert told == [expected], f"decode side of {key} told {told}"
            if att.p_ranks:
                alive = {(r[0], r[1], r[2]) for r in att.p_ranks} - self.lost
                assert alive <= self.closed.get(key, set()), f"prefill ranks {alive - self.closed.get(key, set())} never got TransferClosed for {key}"


TestBrokerInterleavings = BrokerMachine.TestCase
TestBrokerInterleavings.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
