# SPDX-License-Identifier: Apache-2.0
"""The scheduler side of the connector (one per engine, in vLLM's EngineCore): a decode and a prefill scheduler.

Decode engine: the moment vLLM allocates blocks for a request that expects
remote KV, the destination is registered with the broker (on the control
loop: the scheduler never waits on the network). DecodeWaits decides when
a request that will not get its KV may give its blocks back (only once no
WRITE can land in them), and the workers report it failed then. With a
sharded broker it remembers which member each registration went to; when
that member leaves the shard map the request fails (BROKER_SHARD_LOST) and
its blocks wait for the hold rule.

Prefill engine: the step in which a request's prefill completes is marked in
that step's metadata, so each worker hands the blocks to its transfer thread
right after the forward; the blocks stay held until every worker reports
them sent (written, closed or expired).
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass
from typing import Any

from vllm.v1.request import RequestStatus

from kvpush import errors
from kvpush.clock import SystemClock, duration, timestamp
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.control import ControlSession
from kvpush.connector.decode_waits import EVENT_TYPES, DecodeWait, DecodeWaits
from kvpush.connector.handoff import DestinationReady, SourceReady, packed_prompt, prompt_digest
from kvpush.connector.metadata import KvpushHandshake, KvpushMetadata
from kvpush.connector.params import ParamError, TransferParams, parse
from kvpush.connector.report_routing import ReportRouter
from kvpush.connector.report_stream import Report
from kvpush.connector.spans import Spans
from kvpush.connector.window_blocks import add_destination_blocks, window_blocks_to_hold, windows_given_back
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.telemetry.segments import PREFILL_ARRIVAL_NS, TIMING_PARAMS

logger = logging.getLogger(__name__)

# The workers' receive instants kept for results not taken yet (more is a result vLLM will never report).
KV_IN_MEMORY = 10_000


def make_scheduler(config: ConnectorConfig, vllm_config: Any, kv_cache_config: Any) -> DecodeScheduler | PrefillScheduler:
    cls = DecodeScheduler if config.role == "decode" else PrefillScheduler
    return cls(config, vllm_config, kv_cache_config)


class _Scheduler:
    """vLLM's scheduler-side connector hooks, as no-ops; each role overrides what it uses."""

    def __init__(self, config: ConnectorConfig, vllm_config: Any, kv_cache_config: Any):
        self.config = config
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.spans = Spans(config.engine_id, config.role)
        self.kv_cache_manager: Any = None
        self.session: ControlSession | None = None
        self.incarnation = ""

    def on_handshake(self, handshakes: dict[tuple[int, int], KvpushHandshake]) -> None:
        self.incarnation = handshakes[min(handshakes)].incarnation

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return

    def on_new_request(self, request: Any) -> None:
        return

    def update_connector_output(self, output: Any) -> None:
        return

    def shutdown(self) -> None:
        if self.session is not None:
            self.session.close()
        self.spans.close()


class DecodeScheduler(_Scheduler):
    """Registers destinations at allocation and decides when a request that will not receive its KV releases its blocks."""

    def __init__(self, config: ConnectorConfig, vllm_config: Any, kv_cache_config: Any):
        super().__init__(config, vllm_config, kv_cache_config)
        self.waits = DecodeWaits(SystemClock(), config.hold_margin_s)
        self._taken_over: set[str] = set()  # requests whose KV this scheduler receives from a remote prefill (from their first allocation on)
        self._local_hits: dict[str, int] = {}  # the block-aligned local prefix hit vLLM last showed get_num_new_matched_tokens
        self._new_recvs: list[DestinationReady] = []
        # What the control loop heard, applied on the engine thread: (kind, args).
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._receiving: dict[str, Any] = {}  # registered, KV not in yet: req_id -> vLLM's request
        # KV in, first decode step not scheduled yet: (wait, request, when the KV was in: the latest rank's last notification).
        self._received: dict[str, tuple[DecodeWait, Any, int]] = {}
        self._kv_in_ns: dict[str, int] = {}  # the workers' word on when a receive's KV was in (wall ns), until its result is taken
        self._first_steps: dict[str, tuple[DecodeWait, Any, int]] = {}  # first decode step running: (wait, request, its start)
        self.reports: ReportRouter | None = None
        self._outgoing: list[Report] = []  # registrations and cancellations of this step, sent at its end

    def on_handshake(self, handshakes: dict[tuple[int, int], KvpushHandshake]) -> None:
        """Workers registered their ranks; the decode scheduler opens its own control session."""
        super().on_handshake(handshakes)
        self.session = ControlSession(self.config, "kvpush-control-scheduler")
        inbox = self._inbox
        self.session.on_member_left(lambda member, members: inbox.put(("member_left", member, members)))
        self.reports = self.session.report_stream(self.config.engine_id)
        request = rv_pb.StreamTransferEventsRequest(engine_id=self.config.engine_id, incarnation=self.incarnation, event_types=EVENT_TYPES)

        def on_event(message: rv_pb.StreamTransferEventsResponse) -> None:
            inbox.put(("event", message.event))

        self.session.follow_members("StreamTransferEvents", lambda broker: broker.stream_transfer_events(request), lambda member: on_event)

    # ---- vLLM hooks ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if request.request_id in self._taken_over:
            return 0, False
        try:
            params = parse(request.kv_transfer_params)
        except ParamError:
            params = None  # update_state_after_alloc reports it
            if request.kv_transfer_params and "kvpush" in request.kv_transfer_params:
                return max(request.num_prompt_tokens - num_computed_tokens, 0), True
        if params is None or params.role != "decode":
            return 0, False
        # vLLM computes the prompt's last token here whatever it is given (its KV is rewritten by D's first
        # step), so only [local hit, last token) comes from P, and a local hit of all but the last token
        # needs no transfer at all.
        missing = request.num_prompt_tokens - 1 - num_computed_tokens
        self._local_hits[request.request_id] = num_computed_tokens
        return (missing, True) if missing > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        local_hit = self._local_hits.pop(request.request_id, 0)
        if request.request_id in self._taken_over:
            return
        try:
            params = parse(request.kv_transfer_params)
            refusal = ""
        except ParamError as exc:
            params, refusal = None, f"bad request: {exc}"
            if num_external_tokens == 0:
                return
        if (params is None and not refusal) or (params is not None and params.role != "decode"):
            return
        self._taken_over.add(request.request_id)
        if params is not None and params.control_plane and params.control_plane != self.config.control_plane:
            refusal = (f"kv_transfer_params.kvpush.control_plane is {params.control_plane!r} but decode engine "
                       f"{self.config.engine_id} is registered with {self.config.control_plane!r}")
        if params is not None and num_external_tokens == 0 and not refusal:
            # Everything was cached locally: tell the broker so P frees its blocks now.
            self._cancel(params.key, "decode side had the whole prompt cached")
            return
        if not refusal and self.session is None:
            refusal = "the kvpush control-plane session has not started"
        timeout = (params.timeout_s if params is not None and params.timeout_s else None) or self.config.transfer_timeout_s
        wait = self.waits.admit(request.request_id, params, refusal, timeout, time.time_ns())
        if wait.failure:
            return  # nothing named these blocks outside this engine: the next step reports it failed
        assert params is not None, "a request without parameters is admitted with its refusal, so it failed above"
        # D's own prefix-cache hit stays out of the destination: those blocks may be shared with other
        # requests, so no WRITE may reach them, and P moves only the tokens vLLM will load.
        first_token, num_tokens = local_hit, num_external_tokens
        self._new_recvs.append(DestinationReady(wait.req_id, params.transfer_id, params.attempt, first_token, num_tokens, wait.alloc_ns, params.traceparent))
        self._receiving[request.request_id] = request
        self._register(request, params, wait, first_token, num_tokens)

    def _register(self, request: Any, params: TransferParams, wait: DecodeWait, first_token: int, num_tokens: int) -> None:
        table = self.kv_cache_manager.get_block_ids(request.request_id)
        registration = rv_pb.RegisterDestinationRequest(client_request_id=params.client_request_id or request.request_id,
                                                        prefill_engine_id=params.peer_engine_id)
        registration.key.transfer_id, registration.key.attempt = params.key
        destination = registration.destination
        destination.engine_id, destination.incarnation = self.config.engine_id, self.incarnation
        destination.first_token, destination.num_tokens = first_token, num_tokens
        add_destination_blocks(destination, self.kv_cache_config.kv_cache_groups, table, first_token, first_token + num_tokens)
        remaining = wait.deadline - time.monotonic()
        registration.timeout.CopyFrom(duration(remaining))
        # The deadline itself, so neither a resend nor transit time can let the broker extend it.
        registration.deadline.CopyFrom(timestamp(time.time() + remaining))
        registration.hold_margin.CopyFrom(duration(self.config.hold_margin_s))
        if params.traceparent:
            registration.trace_context["traceparent"] = params.traceparent
        spans, inbox, key = self.spans, self._inbox, params.key
        prompt_ids = request.prompt_token_ids  # None: a prompt given as embeddings (not checked)
        self.waits.registered(wait.req_id)

        def prepare() -> None:  # on the control loop, right before it is sent
            if prompt_ids is not None:
                destination.prompt_digest = prompt_digest(packed_prompt(prompt_ids), first_token + num_tokens)
            spans.emit("d.alloc_to_register", wait.alloc_ns, time.time_ns(), params)

        def answered(answer, error) -> None:
            spans.emit("d.register_rpc", report.sent_ns, time.time_ns(), params)
            if error is None:
                inbox.put(("answered", key, answer.response.state, answer.response.fenced))
            elif isinstance(error, (errors.Unavailable, errors.DeadlineExceeded)):
                # The broker may or may not hold it: the broker's word or the hold margin frees the blocks.
                logger.warning("kvpush: registration of %s uncertain (%s); waiting for the transfer", key, error)
            else:
                inbox.put(("refused", key, str(error), error.metadata.get("fenced") == "true"))

        report = Report("registrations", registration, answered, prepare, on_route=lambda member: inbox.put(("routed", key, member)))
        self._outgoing.append(report)

    def _cancel(self, key: tuple[str, int], detail: str) -> None:
        request = rv_pb.CancelTransferRequest(detail=detail)
        request.key.transfer_id, request.key.attempt = key
        self._outgoing.append(Report("cancels", request))

    def build_connector_meta(self, scheduler_output: Any) -> KvpushMetadata:
        now_ns = time.time_ns()
        meta = KvpushMetadata(idle=scheduler_output.total_num_scheduled_tokens == 0)
        self._drain_inbox()
        fails, cancels = self.waits.due()
        for key in cancels:
            self._cancel(key, "decode side gave up on its KV")
        meta.fails = fails
        meta.recvs, self._new_recvs = self._new_recvs, []
        if self._outgoing and self.reports is not None:
            # This step's registrations and cancellations leave in one message.
            self.reports.send_many(self._outgoing)
            self._outgoing = []
        for req_id in scheduler_output.num_scheduled_tokens:
            received = self._received.pop(req_id, None)
            if received is not None:
                # Its first decode step starts; it ends once that step's token is in (update_connector_output).
                wait, request, kv_in_ns = received
                self.spans.segments.segment("d_wait_tail", kv_in_ns, now_ns)
                self._first_steps[req_id] = (wait, request, now_ns)
        return meta

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, *args = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "event":
                self.waits.on_event(args[0])
            elif kind == "routed":
                self.waits.routed(*args)
            elif kind == "member_left":
                self.waits.member_left(*args)
            elif kind == "answered":
                self.waits.registration_answered(*args)
            else:
                self.waits.registration_refused(*args)

    def update_connector_output(self, output: Any) -> None:
        # vLLM calls this after it took the step's tokens, so a first decode step that produced its token
        # ends here, also when vLLM schedules the next step before this one's output (async scheduling).
        now_ns = time.time_ns()
        for req_id in [req_id for req_id, (_, request, _) in self._first_steps.items() if request.num_output_tokens]:
            stepped, _, started_ns = self._first_steps.pop(req_id)
            self._first_step_ended(stepped, started_ns, now_ns)
        self._kv_in_ns.update(getattr(getattr(output, "kv_connector_worker_meta", None), "received_ns", None) or {})
        while len(self._kv_in_ns) > KV_IN_MEMORY:  # instants of receives whose request vLLM dropped first
            del self._kv_in_ns[next(iter(self._kv_in_ns))]
        failed = output.failed_recving or ()
        for req_id in output.finished_recving or ():
            request = self._receiving.pop(req_id, None)
            kv_in_ns = self._kv_in_ns.pop(req_id, now_ns)  # the workers' instant; this one if they gave none
            if req_id in failed:
                continue  # DecodeWaits released it
            received = self.waits.received(req_id)
            if received is not None and request is not None:
                self._received[req_id] = (received, request, kv_in_ns)

    def _first_step_ended(self, stepped: DecodeWait, started_ns: int, end_ns: int) -> None:
        self.spans.emit("d.first_decode_step", started_ns, end_ns, stepped.params)
        self.spans.segments.segment("d_first_decode_step", started_ns, end_ns)
        self.spans.segments.first_step_done(end_ns)  # d_output: its token's trip to the API server

    def request_finished(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        # vLLM keeps the blocks of a request still waiting for remote KV until its receive is reported
        # finished, which DecodeWaits does only once no WRITE can land in them.
        req_id = request.request_id
        self._taken_over.discard(req_id)
        self._local_hits.pop(req_id, None)
        self._receiving.pop(req_id, None)
        self._received.pop(req_id, None)
        self._kv_in_ns.pop(req_id, None)
        first_step = self._first_steps.pop(req_id, None)
        if first_step is not None and request.num_output_tokens:
            # Its first step's token ended it: vLLM frees a finished request before update_connector_output.
            self._first_step_ended(first_step[0], first_step[2], time.time_ns())
        self.waits.aborted(req_id)
        return False, None

    def has_pending_push_work(self) -> bool:
        return len(self.waits) > 0


@dataclass
class PrefillTrack:
    """A prefill request whose KV goes to a decode engine."""

    params: TransferParams
    request: Any
    scheduled_ns: int = 0
    handed_over: bool = False  # its source went to the workers' transfer threads
    blocks_held: bool = False  # vLLM left its blocks to the connector until the workers release them
    window_holds: tuple = ()  # vLLM's blocks of sliding-window groups this connector holds a reference on (see _hold_windows)


class PrefillScheduler(_Scheduler):
    """Marks the step a transferred prefill completes in, and holds its blocks until the workers release them."""

    def __init__(self, config: ConnectorConfig, vllm_config: Any, kv_cache_config: Any):
        super().__init__(config, vllm_config, kv_cache_config)
        self._tracks: dict[str, PrefillTrack] = {}
        self._keys: dict[tuple[str, int], str] = {}
        # State-space (Mamba) layers: prefill legs compute all but the prompt's last token.
        self._has_state = any(type(g.kv_cache_spec).__name__ == "MambaSpec" for g in (kv_cache_config.kv_cache_groups if kv_cache_config else ()))
        self._new_sources: list[SourceReady] = []
        self._cancels: list[tuple[str, int]] = []

    def on_new_request(self, request: Any) -> None:
        try:
            params = parse(request.kv_transfer_params)
        except ParamError as exc:
            logger.error("kvpush: request %s: %s; serving it without a KV transfer", request.request_id, exc)
            return
        if params is None:
            return
        why = ""
        if params.role != "prefill":
            why = f"it is a {params.role} leg sent to prefill engine {self.config.engine_id}"
        elif params.control_plane and params.control_plane != self.config.control_plane:
            why = f"it names control plane {params.control_plane} but this engine is registered with {self.config.control_plane}"
        elif params.key in self._keys:
            why = f"request {self._keys[params.key]} already uses transfer key {params.key}"
        if why:
            logger.error("kvpush: request %s: %s; serving it without a KV transfer", request.request_id, why)
            return
        if self._has_state and request.num_prompt_tokens > 1 and request.prompt_token_ids is not None:
            # D computes the prompt's last token from the state after the others, and a state cannot be stepped back a
            # token: P stops one short, so its state is the one D needs (as upstream's NIXL connectors do).
            del request.prompt_token_ids[-1:]
            del request._all_token_ids[-1:]
            request.num_prompt_tokens -= 1
            request.max_tokens = 1
        self._tracks[request.request_id] = PrefillTrack(params, request)
        self._keys[params.key] = request.request_id

    def build_connector_meta(self, scheduler_output: Any) -> KvpushMetadata:
        now_ns = time.time_ns()
        tokens = scheduler_output.total_num_scheduled_tokens
        meta = KvpushMetadata(idle=tokens == 0, scheduled_tokens=tokens)
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            track = self._tracks.get(req_id)
            if track is None or track.handed_over:
                continue
            request = track.request
            track.scheduled_ns = track.scheduled_ns or now_ns
            completes = request.num_computed_tokens + scheduled >= request.num_prompt_tokens
            if completes and request.sampling_params is not None and request.sampling_params.max_tokens == 1:
                # The request ends in this very step, so nothing can free or
                # preempt its blocks between the forward and the hand-off.
                self._hold_windows(track)
                self._hand_over(track, self.kv_cache_manager.get_block_ids(req_id))
        meta.sources, self._new_sources = self._new_sources, []
        meta.cancels, self._cancels = self._cancels, []
        return meta

    def _hold_windows(self, track: PrefillTrack) -> None:
        """Holds the blocks of the windows D may ask for that vLLM gives back when the request finishes, until every rank has sent."""
        holds = window_blocks_to_hold(self.kv_cache_config.kv_cache_groups, self.kv_cache_manager, track.request)
        if holds:
            self.kv_cache_manager.block_pool.touch(holds)
            track.window_holds = tuple(holds)

    def _hand_over(self, track: PrefillTrack, block_ids: tuple[list[int], ...]) -> None:
        request, params = track.request, track.params
        blocks = []
        for group, ids in enumerate(block_ids):
            block_size = self.kv_cache_config.kv_cache_groups[group].kv_cache_spec.block_size
            blocks.append(tuple(ids[: -(-request.num_prompt_tokens // block_size)]))
        track.handed_over = True
        self._new_sources.append(
            SourceReady(
                req_id=request.request_id,
                transfer_id=params.transfer_id,
                attempt=params.attempt,
                client_request_id=params.client_request_id or request.request_id,
                decode_engine_id=params.peer_engine_id,
                blocks=tuple(blocks),
                num_tokens=request.num_prompt_tokens,
                hold_s=params.timeout_s or self.config.transfer_timeout_s,
                traceparent=params.traceparent,
                arrival_ns=int(request.arrival_time * 1e9),
                scheduled_ns=track.scheduled_ns or time.time_ns(),
                prompt=packed_prompt(request.prompt_token_ids) if request.prompt_token_ids is not None else b"",
            )
        )

    def update_connector_output(self, output: Any) -> None:
        for req_id in output.finished_sending or ():
            self._forget(req_id)

    def request_finished(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        req_id = request.request_id
        track = self._tracks.get(req_id)
        if track is None:
            return False, None
        if not track.handed_over:
            finished_ok = request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
            gone = windows_given_back(self.kv_cache_config.kv_cache_groups, block_ids, request.num_prompt_tokens) if finished_ok else []
            if gone:
                logger.error("kvpush: request %s went on past its prompt and vLLM gave back the sliding windows of KV cache groups %s: "
                             "nothing to transfer (send prefill legs with max_tokens 1)", req_id, gone)
            if finished_ok and not gone and request.num_computed_tokens >= request.num_prompt_tokens:
                self._hand_over(track, block_ids)
            else:
                self._forget(req_id)
                self._cancels.append(track.params.key)
                return False, None
        track.blocks_held = True
        # The answer tells the router when this leg arrived, so that it can measure its dispatch (router_to_p).
        return True, {TIMING_PARAMS: {PREFILL_ARRIVAL_NS: int(request.arrival_time * 1e9)}}

    def _forget(self, req_id: str) -> None:
        track = self._tracks.pop(req_id, None)
        if track is not None and track.window_holds:
            self.kv_cache_manager.block_pool.free_blocks(track.window_holds)
        if track is not None and self._keys.get(track.params.key) == req_id:
            del self._keys[track.params.key]

    def has_pending_push_work(self) -> bool:
        return any(t.blocks_held for t in self._tracks.values())
