# SPDX-License-Identifier: Apache-2.0
"""The scheduler side of the connector (one per engine, in vLLM's EngineCore).

Decode engine: the moment vLLM allocates blocks for a request that expects
remote KV, the destination is registered with the broker (on the control
loop: the scheduler never waits on the network). Broker events and local
deadlines turn into per-request failures that the workers report, so vLLM's
kv_load_failure_policy applies and no request waits forever.

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

from opentelemetry import context as otel_context
from vllm.v1.request import RequestStatus

from kvpush import errors
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.control import ControlSession
from kvpush.connector.metadata import KvpushHandshake, KvpushMetadata, KvpushWorkerMeta, RecvExpected, SourceReady
from kvpush.connector.params import ParamError, TransferParams, parse
from kvpush.connector.spans import Spans
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2
from kvpush.telemetry import extract_context

logger = logging.getLogger(__name__)

# Refusals after which the broker holds nothing for the registration, so no
# WRITE can land and the blocks may be reused at once.
DEFINITE_REFUSALS = (
    errors.InvalidArgument,
    errors.NotFound,
    errors.AlreadyExists,
    errors.FailedPrecondition,
    errors.Aborted,
    errors.PermissionDenied,
    errors.Unauthenticated,
    errors.ResourceExhausted,
)


@dataclass
class DecodeWait:
    """A decode request waiting for its KV."""

    req_id: str
    params: TransferParams
    alloc_ns: int
    free_after: float  # monotonic: fail locally if nothing was heard by then
    fail_reason: str = ""  # set once the request must be reported failed
    fail_sent: bool = False
    received_ns: int = 0


@dataclass
class PrefillTrack:
    """A prefill request whose KV goes to a decode engine."""

    params: TransferParams
    request: Any
    scheduled_ns: int = 0
    marked: bool = False  # its source was handed to the workers
    held: bool = False  # vLLM left its blocks to us


class KvpushScheduler:
    """Scheduler-side logic for either role."""

    def __init__(self, config: ConnectorConfig, vllm_config: Any, kv_cache_config: Any):
        self.config = config
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.is_decode = config.role == "decode"
        self.spans = Spans(config.engine_id, config.role)
        self.kv_cache_manager: Any = None
        self.session: ControlSession | None = None
        self.incarnation = ""
        # decode
        self._waits: dict[str, DecodeWait] = {}
        self._by_key: dict[tuple[str, int], str] = {}
        self._handled: set[str] = set()  # decode requests whose remote KV was dealt with
        self._new_recvs: list[RecvExpected] = []
        self._events: queue.SimpleQueue = queue.SimpleQueue()  # (key or req_id, reason) from the control loop
        self._first_step: dict[str, int] = {}  # received request -> start of its first decode step (0 = not yet)
        self._received: dict[str, DecodeWait] = {}
        # prefill
        self._tracks: dict[str, PrefillTrack] = {}
        self._new_sources: list[SourceReady] = []
        self._cancels: list[tuple[str, int]] = []

    # ---- startup ----------------------------------------------------------------------

    def on_handshake(self, handshakes: dict[tuple[int, int], KvpushHandshake]) -> None:
        """Workers registered their ranks; the decode scheduler opens its own control session."""
        first = handshakes[min(handshakes)]
        self.incarnation = first.incarnation
        if not self.is_decode:
            return
        self.session = ControlSession(self.config, "kvpush-control-scheduler")
        self.session.set_engine_token(first.engine_token)
        request = rv_pb.StreamTransferEventsRequest(engine_id=self.config.engine_id, incarnation=self.incarnation)
        broker = self.session.broker
        self.session.follow("StreamTransferEvents", lambda: broker.stream_transfer_events(request), self._on_event)

    def _on_event(self, message: rv_pb.StreamTransferEventsResponse) -> None:
        event = message.event
        if event.type == transfer_pb2.TRANSFER_EVENT_TYPE_ENDED:
            reason = transfer_pb2.EndReason.Name(event.reason)
            self._events.put(((event.key.transfer_id, event.key.attempt), f"{reason}: {event.detail}"))

    # ---- vLLM hooks ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if not self.is_decode or request.request_id in self._handled:
            return 0, False
        try:
            params = parse(request.kv_transfer_params)
        except ParamError:
            params = None  # update_state_after_alloc reports it
            if request.kv_transfer_params and "kvpush" in request.kv_transfer_params:
                return max(request.num_prompt_tokens - num_computed_tokens, 0), True
        if params is None or params.role != "decode":
            return 0, False
        missing = request.num_prompt_tokens - num_computed_tokens
        return (missing, True) if missing > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if not self.is_decode or request.request_id in self._handled:
            return
        try:
            params = parse(request.kv_transfer_params)
        except ParamError as exc:
            if num_external_tokens > 0:
                self._handled.add(request.request_id)
                self._start_wait(request, None, f"bad request: {exc}")
            return
        if params is None or params.role != "decode":
            return
        self._handled.add(request.request_id)
        if params.control_plane and params.control_plane != self.config.control_plane:
            if num_external_tokens > 0:
                self._start_wait(request, params, f"kv_transfer_params.kvpush.control_plane is {params.control_plane!r} but "
                                 f"decode engine {self.config.engine_id} is registered with {self.config.control_plane!r}")
            return
        if num_external_tokens == 0:
            # Everything was cached locally: tell the broker so P frees its blocks now.
            self._cancel(params.key, "decode side had the whole prompt cached")
            return
        wait = self._start_wait(request, params, "")
        self._register(request, params, wait)

    def _start_wait(self, request: Any, params: TransferParams | None, fail_reason: str) -> DecodeWait:
        timeout = (params.timeout_s if params and params.timeout_s else None) or self.config.transfer_timeout_s
        wait = DecodeWait(
            req_id=request.request_id,
            params=params or TransferParams("decode", "invalid", 1, "", None, "", ""),
            alloc_ns=time.time_ns(),
            free_after=time.monotonic() + timeout + self.config.free_margin_s,
            fail_reason=fail_reason,
        )
        self._waits[wait.req_id] = wait
        if params is not None:
            self._by_key[params.key] = wait.req_id
        self._new_recvs.append(RecvExpected(wait.req_id, wait.params.transfer_id, wait.params.attempt, wait.alloc_ns, wait.params.traceparent))
        return wait

    def _register(self, request: Any, params: TransferParams, wait: DecodeWait) -> None:
        first_token = request.num_computed_tokens
        num_tokens = request.num_prompt_tokens - first_token
        table = self.kv_cache_manager.get_block_ids(request.request_id)
        registration = rv_pb.RegisterDestinationRequest(
            client_request_id=params.client_request_id or request.request_id,
            prefill_engine_id=params.peer_engine_id,
        )
        registration.key.transfer_id, registration.key.attempt = params.key
        destination = registration.destination
        destination.engine_id, destination.incarnation = self.config.engine_id, self.incarnation
        destination.first_token, destination.num_tokens = first_token, num_tokens
        for group, spec_group in enumerate(self.kv_cache_config.kv_cache_groups):
            block_size = spec_group.kv_cache_spec.block_size
            start = first_token // block_size
            count = -(-(first_token + num_tokens) // block_size) - start
            destination.blocks.add(group_index=group, block_ids=table[group][start : start + count])
        registration.timeout.FromNanoseconds(int((wait.free_after - time.monotonic() - self.config.free_margin_s) * 1e9))
        session, spans, events = self.session, self.spans, self._events
        parent = extract_context({"traceparent": params.traceparent}) if params.traceparent else None

        async def register() -> None:
            token = otel_context.attach(parent) if parent is not None else None
            start = time.time_ns()
            spans.emit("d.alloc_to_register", wait.alloc_ns, start, params)
            try:
                await session.broker.register_destination(registration)
            except DEFINITE_REFUSALS as exc:
                events.put((params.key, f"registration refused: {exc}"))
            except errors.KvpushError as exc:
                # The broker may or may not hold it: only the local deadline frees the blocks.
                logger.warning("kvpush: registration of %s uncertain (%s); waiting for the deadline", params.key, exc)
            finally:
                spans.emit("d.register_rpc", start, time.time_ns(), params)
                if token is not None:
                    otel_context.detach(token)

        if session is None:
            events.put((params.key, "kvpush control plane session not started"))
            return
        session.submit(register(), "RegisterDestination")

    def _cancel(self, key: tuple[str, int], detail: str) -> None:
        if self.session is None:
            return
        request = rv_pb.CancelTransferRequest(detail=detail)
        request.key.transfer_id, request.key.attempt = key
        broker = self.session.broker

        self.session.submit(broker.cancel_transfer(request), f"CancelTransfer {key}")

    def on_new_request(self, request: Any) -> None:
        if self.is_decode:
            return
        try:
            params = parse(request.kv_transfer_params)
        except ParamError as exc:
            logger.error("kvpush: request %s: %s; serving it without a KV transfer", request.request_id, exc)
            return
        if params is None:
            return
        if params.role != "prefill":
            logger.error("kvpush: request %s is a %s leg sent to prefill engine %s; serving it without a KV transfer",
                         request.request_id, params.role, self.config.engine_id)
            return
        if params.control_plane and params.control_plane != self.config.control_plane:
            logger.error("kvpush: request %s names control plane %s but prefill engine %s is registered with %s; "
                         "serving it without a KV transfer", request.request_id, params.control_plane,
                         self.config.engine_id, self.config.control_plane)
            return
        self._tracks[request.request_id] = PrefillTrack(params, request)

    def build_connector_meta(self, scheduler_output: Any) -> KvpushMetadata:
        now_ns = time.time_ns()
        meta = KvpushMetadata(idle=scheduler_output.total_num_scheduled_tokens == 0)
        if self.is_decode:
            self._drain_events()
            now = time.monotonic()
            for wait in self._waits.values():
                if not wait.fail_reason and now > wait.free_after:
                    wait.fail_reason = "no transfer outcome before the deadline"
                    self._cancel(wait.params.key, wait.fail_reason)
                if wait.fail_reason and not wait.fail_sent:
                    wait.fail_sent = True
                    meta.fails[wait.req_id] = wait.fail_reason
            meta.recvs, self._new_recvs = self._new_recvs, []
            for req_id in scheduler_output.num_scheduled_tokens:
                if req_id in self._first_step and not self._first_step[req_id]:
                    self._first_step[req_id] = now_ns
            return meta
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            track = self._tracks.get(req_id)
            if track is None or track.marked:
                continue
            request = track.request
            track.scheduled_ns = track.scheduled_ns or now_ns
            completes = request.num_computed_tokens + scheduled >= request.num_prompt_tokens
            if completes and request.sampling_params is not None and request.sampling_params.max_tokens == 1:
                # The request ends in this very step, so nothing can free or
                # preempt its blocks between the forward and the hand-off.
                self._mark(track, self.kv_cache_manager.get_block_ids(req_id))
        meta.sources, self._new_sources = self._new_sources, []
        meta.cancels, self._cancels = self._cancels, []
        return meta

    def _mark(self, track: PrefillTrack, block_ids: tuple[list[int], ...]) -> None:
        request, params = track.request, track.params
        blocks = []
        for group, ids in enumerate(block_ids):
            block_size = self.kv_cache_config.kv_cache_groups[group].kv_cache_spec.block_size
            blocks.append(tuple(ids[: -(-request.num_prompt_tokens // block_size)]))
        track.marked = True
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
            )
        )

    def _drain_events(self) -> None:
        while True:
            try:
                key_or_id, reason = self._events.get_nowait()
            except queue.Empty:
                return
            req_id = self._by_key.get(key_or_id)
            wait = self._waits.get(req_id) if req_id else None
            if wait is not None and not wait.fail_reason:
                wait.fail_reason = reason

    def update_connector_output(self, output: Any) -> None:
        now_ns = time.time_ns()
        if isinstance(output.kv_connector_worker_meta, KvpushWorkerMeta) and self.session is not None:
            self.session.set_engine_token(output.kv_connector_worker_meta.engine_token)
        for req_id in output.finished_recving or ():
            wait = self._waits.pop(req_id, None)
            if wait is None:
                continue
            self._by_key.pop(wait.params.key, None)
            if req_id not in (output.failed_recving or ()):
                self._first_step[req_id] = 0
                wait.received_ns = now_ns
                self._received[req_id] = wait
        for req_id, started in list(self._first_step.items()):
            if started:
                wait = self._received.pop(req_id, None)
                if wait is not None:
                    self.spans.emit("d.first_decode_step", started, now_ns, wait.params)
                del self._first_step[req_id]
        for req_id in output.finished_sending or ():
            self._tracks.pop(req_id, None)

    def request_finished(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        req_id = request.request_id
        if self.is_decode:
            self._handled.discard(req_id)
            self._first_step.pop(req_id, None)
            self._received.pop(req_id, None)
            wait = self._waits.get(req_id)
            if wait is not None and not wait.fail_reason:
                # Aborted while waiting: vLLM keeps the blocks until we report
                # the receive finished, which the broker allows once no WRITE
                # can land any more (or our deadline passes).
                self._cancel(wait.params.key, "decode request aborted")
            return False, None
        track = self._tracks.get(req_id)
        if track is None:
            return False, None
        if not track.marked:
            finished_ok = request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
            if finished_ok and request.num_computed_tokens >= request.num_prompt_tokens:
                self._mark(track, block_ids)
            else:
                del self._tracks[req_id]
                self._cancels.append(track.params.key)
                return False, None
        track.held = True
        return True, None

    def has_pending_push_work(self) -> bool:
        if self.is_decode:
            return bool(self._waits)
        return any(t.held for t in self._tracks.values())

    def shutdown(self) -> None:
        if self.session is not None:
            self.session.close()
