# SPDX-License-Identifier: Apache-2.0
"""One arrival path for both sides of a rendezvous: the decode side's registration and the prefill side's prefill-done.

Either may come first. An arrival is checked whole (its key, its caller,
its engines and their plan, its blocks and deadline) before it changes
anything; an identical repeat gets the answer the first copy got; the
second side's arrival matches the attempt and the machine sends the
orders. The checks that need no state are in checks.py and plans.py.
"""

from __future__ import annotations

from collections.abc import Callable

from opentelemetry.context import Context

from kvpush.clock import Clock
from kvpush.errors import FailedPrecondition, InvalidArgument, Reason
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.services.broker import attempts as a
from kvpush.services.broker import checks
from kvpush.services.broker.attempts import Attempt
from kvpush.services.broker.config import BrokerConfig
from kvpush.services.broker.machine import AttemptMachine
from kvpush.services.broker.plans import DECODE, PREFILL, EngineInfo, Plan, Planner, check_blocks
from kvpush.services.broker.store import AttemptStore
from kvpush.services.common import validation


class Arrivals:
    """Checks and applies arrivals; the core owns the parts it works on."""

    def __init__(self, config: BrokerConfig, clock: Clock, store: AttemptStore, machine: AttemptMachine, planner: Planner,
                 find_held: Callable[[str, int], Attempt | None], check_owner: Callable[[str, str], None]):
        self._config = config
        self._clock = clock
        self._store = store
        self._machine = machine
        self._planner = planner
        self._find_held = find_held  # the attempt if this member holds it, once any membership change is acted on
        self._check_owner = check_owner  # refuses (NOT_SHARD_OWNER) a transfer another member owns

    def arrive(self, side: tr_pb.TransferSide, request, caller_engine_id: str, parent: Context | None) -> Attempt:
        """Checks one side's arrival and moves its attempt: waits for the other side, or matches and orders the WRITEs."""
        decode = side == a.DECODE_SIDE
        transfer_id, number = checks.check_key(request.key)
        mine_field = "destination" if decode else "source"
        if not request.HasField(mine_field):
            raise InvalidArgument(f"{mine_field} is required", reason=Reason.FIELD_REQUIRED, field=mine_field)
        mine = request.destination if decode else request.source
        checks.check_caller(mine.engine_id, caller_engine_id, f"{mine_field}.engine_id")
        now = self._clock.now()

        att = self._find_held(transfer_id, number)
        if att is not None:
            recorded = att.dest if decode else att.src
            if recorded is not None:
                if not checks.same_arrival(recorded, request, side):
                    raise checks.ended_error(att) if att.ended else checks.conflict(att, "RegisterDestination" if decode else "ReportPrefillDone")
                if att.rejection is not None and att.rejection[0] == side:
                    raise att.rejection[1]
                return att  # an identical repeat gets the same answer
            late_prefill_done = not decode and att.state == a.DONE
            if att.ended and not late_prefill_done:
                if not decode:  # e.g. D's full prefix hit cancelled it first: every rank of P lets its blocks go now
                    self._machine.close_ranks(att, self._planner.rank_keys_of(mine.engine_id, mine.incarnation, PREFILL))
                raise checks.ended_error(att)
        if att is None or not att.ended:
            self._check_owner(transfer_id, "key.transfer_id")  # it would start or move an attempt

        # Checks that depend on the engines and the request's content.
        my_info = self._planner.engine(
            mine.engine_id, DECODE if decode else PREFILL, f"{mine_field}.engine_id", incarnation=mine.incarnation, incarnation_field=f"{mine_field}.incarnation"
        )
        validation.check_text(request.client_request_id, "client_request_id", self._config.max_text_length, required=False)
        peer_id, peer_field = (request.prefill_engine_id, "prefill_engine_id") if decode else (request.decode_engine_id, "decode_engine_id")
        plan: Plan | None = None
        peer_info: EngineInfo | None = None
        if decode or peer_id:
            peer_info = self._planner.engine(peer_id, PREFILL if decode else DECODE, peer_field)
            p_info, d_info = (peer_info, my_info) if decode else (my_info, peer_info)
            plan = self._planner.plan(p_info, d_info, peer_field, f"{mine_field}.engine_id" if decode else peer_field)
        check_blocks(mine.blocks, my_info, mine.num_tokens, mine.first_token if decode else 0, mine_field)
        deadline = now + validation.positive_seconds(request.timeout, "timeout", self._config.max_timeout_s)
        write_timeout = 0.0
        if decode:
            deadline = min(deadline, checks.requested_deadline(request, now, self._clock.wall(), self._config))
            if deadline <= now:
                raise FailedPrecondition("the registration's deadline has passed", reason=Reason.DEADLINE_PASSED, field="deadline")
            write_timeout = checks.write_timeout(request, self._config)

        if att is None:
            att = self._store.create(transfer_id, number, now)
        other = att.src if decode else att.dest
        if other is not None:
            checks.check_sides_agree(att, request, side)
        if not decode and att.state == a.DONE:
            # Early orders let every producer rank write before rank 0's
            # report arrived: the report is late, not wrong.
            assert att.dest is not None, "DONE: the decode side registered"
            self._check_token_counts(att, mine, att.dest.destination, side, now)
            att.src, att.rejection = request, None  # an earlier refused report is not this one's answer
            att.note(a.TL_PREFILL_DONE, now, mine.engine_id)
            return att

        created = att.state == a.NEW
        if decode:
            att.dest = request
            att.write_timeout = write_timeout
            att.dest_deadline = deadline
            att.keep_until = max(att.keep_until, deadline)
            att.note(a.TL_REGISTERED, now, mine.engine_id)
        else:
            att.src = request
            att.src_deadline = deadline
            att.note(a.TL_PREFILL_DONE, now, mine.engine_id)
        if not att.client_request_id:
            att.client_request_id = request.client_request_id
        if decode:
            self._store.bind_decode(att, mine.engine_id, mine.incarnation)
            assert peer_info is not None, "the decode side always names its prefill engine"
            self._store.bind_prefill(att, peer_id, peer_info.engine.incarnation, peer_info.rank_keys)
            att.plan = plan
        else:
            self._store.bind_prefill(att, mine.engine_id, mine.incarnation, my_info.rank_keys)
            if plan is not None:
                self._store.bind_decode(att, peer_id, plan.decode_engine.incarnation)
        self._store.set_deadline(att, min(att.dest_deadline, att.src_deadline))

        if other is None:
            self._machine.wait(att, side, parent, now)
            if created:
                self._machine.supersede_older(att, now)
            return att
        if decode:
            assert att.src is not None, "other is att.src"
            src, dest = att.src.source, mine
        else:
            assert att.dest is not None, "other is att.dest"
            src, dest = mine, att.dest.destination
        self._check_token_counts(att, src, dest, side, now)
        self._machine.match(att, parent, now)
        return att

    def _check_token_counts(self, att: Attempt, src: tr_pb.Source, dest: tr_pb.Destination, second: tr_pb.TransferSide, now: float) -> None:
        """The rendezvous completes only if P computed every token D wants; else both sides fail."""
        error = checks.token_count_mismatch(src, dest, second)
        if error is None:
            return
        att.rejection = (second, error)
        if not att.ended:
            self._machine.end(att, a.FAILED, tr_pb.END_REASON_TOKEN_COUNT_MISMATCH, error.message, now)
        raise error
