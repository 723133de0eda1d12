# SPDX-License-Identifier: Apache-2.0
"""The simulated processes: control plane, prefill engine (ranks), decode engine, router.

Each runs kvpush's own code — RegistrarCore, BrokerCore, ProducerCore,
ConsumerCore, DecodeWaits — and stands in only for what surrounds it: gRPC
(unary calls that may be lost, doubled, delayed or time out; streams that
deliver in order and can break), vLLM's scheduling (prefill and decode take
time, blocks are allocated and freed) and the router's retry policy.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvpush.connector.consumer import ConsumerCore
from kvpush.connector.decode_waits import DecodeWaits
from kvpush.connector.handoff import DestinationReady, SourceReady, packed_prompt, prompt_digest
from kvpush.connector.params import TransferParams
from kvpush.connector.producer import ProducerCore
from kvpush.connector.write_plans import LocalLayout, WritePlan
from kvpush.engine.v1 import engine_pb2
from kvpush.errors import KvpushError, Unavailable
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.services.broker.config import BrokerConfig
from kvpush.services.broker.core import BrokerCore
from kvpush.services.common import sample_engines as sample
from kvpush.services.common.clock import timestamp
from kvpush.services.common.validation import duration
from kvpush.services.registrar.config import RegistrarConfig
from kvpush.services.registrar.core import RegistrarCore
from kvpush.sim.checks import Violations
from kvpush.sim.nixl import DecodeAgent, DecodeMemory, Fabric, ProducerTransport, SimPlan
from kvpush.sim.world import Faults, Network, Process, Stream, World

P_ENGINE, D_ENGINE = "prefill-0", "decode-0"
BLOCK_SIZE = 16
# Layers of the simulated model: a layer-progressive prefill engine posts them in parts.
LAYERS = frozenset(range(3))


def prompt_of(prompt_id: int, num_tokens: int) -> bytes:
    """A client request's prompt (packed): its first token names it, so two requests' prompts differ in every prefix."""
    return packed_prompt([prompt_id, *range(1, num_tokens)])


def prompt_id_of(packed: bytes) -> int:
    return int.from_bytes(packed[:4], "little")


@dataclass(frozen=True)
class Timing:
    """The schedule's time constants, scaled down from production so a schedule spans seconds."""

    broker: BrokerConfig = BrokerConfig(
        max_clock_skew_s=0.05, write_timeout_s=0.2, stream_lease_s=0.6, fence_margin_s=0.1, retention_s=2.0, max_timeout_s=30.0, outbox_capacity=64
    )
    registrar: RegistrarConfig = RegistrarConfig(default_lease_ttl_s=1.0, min_lease_ttl_s=0.2, max_lease_ttl_s=5.0)
    hold_margin_s: float = 0.5
    rpc_timeout_s: float = 0.3
    rpc_tries: int = 3
    reconnect_s: float = 0.1
    engine_step_s: float = 0.01  # a decode engine's idle step while requests wait
    transfer_poll_s: float = 0.002
    write_time: tuple[float, float] = (0.001, 0.15)
    prefill_time: tuple[float, float] = (0.02, 0.3)
    decode_time: tuple[float, float] = (0.02, 0.2)
    request_timeout: tuple[float, float] = (1.0, 3.0)
    router_slack_s: float = 0.5
    decode_blocks: int = 48


class NoSpans:
    enabled = False

    def emit(self, *args, **kwargs) -> None:
        pass


class Rpc:
    """Unary calls from a client process to the control plane, with the kvpush client's timeout and retries."""

    def __init__(self, sim: Simulation, client: Process, caller: str):
        self.sim = sim
        self.client = client
        self.caller = caller
        self.cut_until = 0.0  # a network cut between this client and the control plane

    def call(self, method: str, request, on_done=None, *, tries: int | None = None) -> None:
        """on_done(response, error); error is Unavailable when no answer came in time after every try."""
        state = {"done": False}
        tries = tries or self.sim.timing.rpc_tries

        def finish(response, error) -> None:
            if not state["done"]:
                state["done"] = True
                if on_done is not None:
                    on_done(response, error)

        def attempt(n: int) -> None:
            if state["done"]:
                return
            if self.sim.world.time >= self.cut_until:
                self.sim.cp.receive(self, method, request, finish)
            if n + 1 < tries:
                self.client.later(self.sim.timing.rpc_timeout_s, attempt, n + 1)
            else:
                self.client.later(self.sim.timing.rpc_timeout_s, finish, None, Unavailable(f"{method}: no answer"))

        attempt(0)

    def reply(self, finish, response, error) -> None:
        if self.sim.world.time >= self.cut_until:
            self.sim.network.deliver(self.client, finish, response, error)


class ControlPlane:
    """Registrar and broker in one process (the embedded default); a kill loses all of their state."""

    def __init__(self, sim: Simulation):
        self.sim = sim
        self.proc = Process(sim.world, "control-plane", sim.world.rng.uniform(-1, 1) * sim.faults.skew_s)
        self.streams: list[tuple[Stream, object, str]] = []
        self._lease_seq = 0
        self.start()

    def start(self) -> None:
        self.registrar = RegistrarCore(self.sim.timing.registrar, self.proc, new_lease_id=self._new_lease_id)
        self.broker = BrokerCore(self.registrar, self.sim.timing.broker, self.proc)
        self.streams = []
        self._next_tick = float("inf")
        self._tick()

    def _new_lease_id(self) -> str:
        self._lease_seq += 1
        return f"lease-{self._lease_seq}"

    def receive(self, rpc: Rpc, method: str, request, finish) -> None:
        self.sim.network.deliver(self.proc, self._handle, rpc, method, request, finish)

    def _handle(self, rpc: Rpc, method: str, request, finish) -> None:
        try:
            response = self._dispatch(method, request, rpc.caller)
            error = None
        except KvpushError as exc:
            response, error = None, exc
        rpc.reply(finish, response, error)
        self._tick()

    def _dispatch(self, method: str, request, caller: str):
        broker, registrar = self.broker, self.registrar
        if method == "RegisterEngineRank":
            return registrar.register(request)
        if method == "KeepAlive":
            return registrar.keep_alive(request.lease_ids, caller)
        if method == "RegisterDestination":
            return broker.register_destination(request, caller)
        if method == "ReportPrefillDone":
            return broker.report_prefill_done(request, caller)
        if method == "ReportWriteResult":
            return broker.report_write_result(request, caller)
        if method == "CancelTransfer":
            return broker.cancel(request.key, None if caller == "router" else caller, request.detail)
        raise ValueError(method)

    # ---- streams ----

    def open_stream(self, kind: str, request, client: Process, caller: str, on_message, on_broken, on_refused) -> None:
        """Opens a stream as the server would (on_refused, later, when the server refuses it)."""
        stream = Stream(self.sim.network, client, on_message, on_broken)

        def subscribe() -> None:
            try:
                if kind == "orders":
                    subscription = self.broker.subscribe_producer(request, caller)
                elif kind == "events":
                    subscription = self.broker.subscribe_decode(request, caller)
                else:
                    subscription = self.registrar.watch(request.role)
            except KvpushError as exc:
                self.sim.network.deliver(client, on_refused, exc, lossy=False)
                return
            self.streams.append((stream, subscription, kind))
            if kind == "orders":
                self.proc.later(self.broker.heartbeat_interval_s, self._heartbeat, stream, subscription)
            self._tick()

        self.sim.network.deliver(self.proc, subscribe, lossy=False)

    def _heartbeat(self, stream: Stream, subscription) -> None:
        if stream.broken or not subscription.active:
            return
        if not len(subscription.outbox):
            stream.send(self.broker.heartbeat())
        self.proc.later(self.broker.heartbeat_interval_s, self._heartbeat, stream, subscription)

    def _pump(self) -> None:
        """Writes what every stream's outbox holds; ends streams the core closed or replaced."""
        kept = []
        for stream, subscription, kind in self.streams:
            for item in subscription.outbox.drain():
                stream.send(item)
            active = subscription.active if kind != "watch" else not subscription.outbox.closed
            if stream.broken or not active:
                self._end_stream(stream, subscription, kind)
                stream.break_(self.sim.network.delay())
            else:
                kept.append((stream, subscription, kind))
        self.streams = kept

    def _end_stream(self, stream, subscription, kind: str) -> None:
        if kind == "watch":
            self.registrar.unwatch(subscription)
        else:
            self.broker.unsubscribe(subscription)

    def break_streams(self, client: Process | None, notice_after: float) -> None:
        """Breaks every stream (to one client, or all); the server notices at once."""
        for stream, _, _ in list(self.streams):
            if client is None or stream.client is client:
                stream.break_(notice_after)
        self._pump()

    def _tick(self, scheduled: float | None = None) -> None:
        """Runs the cores' timers (what their DeadlineRunners do) and writes out what they queued."""
        if scheduled is not None:
            if scheduled != self._next_tick:
                return  # superseded by an earlier one
            self._next_tick = float("inf")
        due = [t for t in (self.registrar.sweep(), self.broker.tick()) if t is not None]
        self._pump()
        if due and min(due) < self._next_tick:
            self._next_tick = min(due)
            self.proc.later(max(0.0, self._next_tick - self.proc.now()) + 1e-6, self._tick, self._next_tick)

    def kill(self, downtime: float) -> None:
        self.proc.kill()
        for stream, _, _ in self.streams:
            stream.break_(self.sim.network.delay())
        self.streams = []
        self.sim.world.at(self.sim.world.time + downtime, self._restart)

    def _restart(self) -> None:
        self.proc.revive()
        self.start()


class EngineLink:
    """An engine rank's registration, keep-alive and streams to the control plane (what ControlSession does)."""

    def __init__(self, sim: Simulation, proc: Process, rpc: Rpc, request: reg_pb.RegisterEngineRankRequest, on_ready):
        self.sim, self.proc, self.rpc, self.request, self.on_ready = sim, proc, rpc, request, on_ready
        self.lease_id = ""
        self._register()

    def _register(self) -> None:
        def done(response, error) -> None:
            if error is not None:
                self.proc.later(self.sim.timing.reconnect_s, self._register)
                return
            first = not self.lease_id
            self.lease_id = response.lease_id
            if first:
                self.proc.later(self._renew_every(), self._keep_alive)
                self.on_ready()

        self.rpc.call("RegisterEngineRank", self.request, done)

    def _renew_every(self) -> float:
        return self.sim.timing.registrar.default_lease_ttl_s / 3

    def _keep_alive(self) -> None:
        def done(response, error) -> None:
            if error is None and self.lease_id in response.unknown_lease_ids:
                self._register()

        self.rpc.call("KeepAlive", reg_pb.KeepAliveRequest(lease_ids=[self.lease_id]), done, tries=1)
        self.proc.later(self._renew_every(), self._keep_alive)

    def follow(self, kind: str, request, on_open, on_message, on_lost) -> None:
        """Keeps a stream open, reopening after it breaks or is refused."""

        def reopen(*_args) -> None:
            on_lost()
            self.proc.later(self.sim.timing.reconnect_s, open_)

        def open_() -> None:
            if self.sim.world.time < self.rpc.cut_until:
                self.proc.later(self.sim.timing.reconnect_s, open_)
                return
            on_open()
            self.sim.cp.open_stream(kind, request, self.proc, self.rpc.caller, on_message, reopen, reopen)

        open_()


def _rank_request(engine_id: str, role: int, incarnation: str, tp_rank: int, tp_size: int, ttl: float) -> reg_pb.RegisterEngineRankRequest:
    request = sample.rank_request(engine_id, role, incarnation=incarnation, tp_rank=tp_rank, tp_size=tp_size, lease_ttl_s=ttl, block_size=BLOCK_SIZE)
    request.nixl.agent_name = f"{engine_id}.{incarnation}.tp{tp_rank}"
    request.nixl.agent_metadata = request.nixl.agent_name.encode()
    return request


class PrefillRank:
    def __init__(self, engine: PrefillEngine, tp_rank: int):
        self.engine = engine
        sim = engine.sim
        self.transport = ProducerTransport(engine.proc, sim.fabric, f"{P_ENGINE}.{engine.incarnation}.tp{tp_rank}",
                                           sim.timing.write_time, sim.faults.stuck_writes, sim.violations)
        kv_layout = engine_pb2.KvLayout(total_kv_heads=2, regions=[engine_pb2.KvRegion(layer_index=layer) for layer in sorted(LAYERS)])
        layout = LocalLayout(kv_layout, tp_rank, engine.tp_size, 0)
        self.core = ProducerCore(self.transport, layout, P_ENGINE, self._report, NoSpans(), engine.proc, plan_writes=self._plan)
        self._stream = 0
        self._next_step = float("inf")
        request = _rank_request(P_ENGINE, sample.PREFILL, engine.incarnation, tp_rank, engine.tp_size, sim.timing.registrar.default_lease_ttl_s)
        self.link = EngineLink(sim, engine.proc, engine.rpc, request, self._linked)

    def _linked(self) -> None:
        orders = rv_pb.StreamWriteOrdersRequest(engine_id=P_ENGINE, incarnation=self.engine.incarnation, tp_rank=self.core.local.tp_rank, early_orders=True)
        self.link.follow("orders", orders, self._opened, self._on_order_message, self._lost)
        watch = reg_pb.WatchEnginesRequest(role=engine_pb2.ENGINE_ROLE_DECODE)
        self.link.follow("watch", watch, lambda: None, lambda m: self.handle(("engine", m)), lambda: None)

    def _opened(self) -> None:
        self._stream += 1
        self.handle(("stream_opened", self._stream))

    def _on_order_message(self, message) -> None:
        self.handle(("stream", self._stream, message))

    def _lost(self) -> None:
        self.handle(("stream_lost", self._stream))

    def _plan(self, source, order, peer, layers: frozenset[int] | None = None) -> list[WritePlan]:
        dest = order.order.destination
        blocks = tuple(dest.blocks[0].block_ids)
        # The bytes a WRITE moves are what the source holds of the destination's range,
        # which prompt's KV they are, and of which layers.
        tokens = (dest.first_token, min(dest.num_tokens, source.ready.num_tokens - dest.first_token), prompt_id_of(source.ready.prompt),
                  LAYERS if layers is None else layers)
        return [WritePlan(d_rank, SimPlan(blocks, tokens), len(self.engine.ranks)) for d_rank in order.order.decode_tp_ranks]

    def _report(self, request) -> None:
        self.engine.rpc.call("ReportWriteResult", request)

    def handle(self, item: tuple) -> None:
        self.core.handle(item)
        self.step()

    def step(self) -> None:
        self._next_step = float("inf")
        due = self.core.step()
        released, _ = self.core.take_released()
        self.engine.released(released)
        now = self.engine.proc.now()
        if due is not None and due <= now:
            due = now + self.engine.sim.timing.transfer_poll_s  # as the transfer thread: never sooner than its poll interval
        if self.core.busy:
            due = now + self.engine.sim.timing.transfer_poll_s if due is None else min(due, now + self.engine.sim.timing.transfer_poll_s)
        if due is not None and due < self._next_step:
            self._next_step = due
            self.engine.proc.later(max(0.0, due - now), self._scheduled_step, due)

    def _scheduled_step(self, due: float) -> None:
        if due == self._next_step:
            self.step()


@dataclass
class PrefillRequest:
    req_id: str
    key: tuple[str, int]
    num_tokens: int
    prompt_id: int
    decode_engine: str
    timeout_s: float
    router_leg: object
    done: bool = False
    aborted: bool = False
    computing: bool = False  # its last forward runs: the source is handed over at its end, aborted or not
    held_by: set[int] = field(default_factory=set)  # ranks still holding the source


class PrefillEngine:
    def __init__(self, sim: Simulation):
        self.sim = sim
        self.tp_size = sim.world.rng.choice((1, 2))
        self.proc = Process(sim.world, P_ENGINE, sim.world.rng.uniform(-1, 1) * sim.faults.skew_s)
        self.rpc = Rpc(sim, self.proc, P_ENGINE)
        self.incarnation_seq = 0
        self.requests: dict[str, PrefillRequest] = {}
        self.progressive = sim.variants.random() < 0.5  # layer-progressive push
        self.start()

    def start(self) -> None:
        self.incarnation_seq += 1
        self.incarnation = f"p-inc-{self.incarnation_seq}"
        self.requests = {}
        self.ranks = [PrefillRank(self, tp) for tp in range(self.tp_size)]

    def leg(self, req_id: str, key, num_tokens: int, prompt_id: int, timeout_s: float, router_leg) -> None:
        """The router's prefill leg arrives."""
        request = PrefillRequest(req_id, key, num_tokens, prompt_id, D_ENGINE, timeout_s, router_leg)
        self.requests[req_id] = request
        rng = self.sim.world.rng
        prefill_s = rng.uniform(*self.sim.timing.prefill_time)
        if self.progressive:  # earlier chunks have no KV to push: the last forward starts somewhere in the prefill
            forward_s = prefill_s * self.sim.variants.uniform(0.1, 0.7)
            self.proc.later(prefill_s - forward_s, self._forward_starts, request, forward_s)
        else:
            self.proc.later(prefill_s, self._prefill_done, request)

    def abort(self, req_id: str) -> None:
        request = self.requests.get(req_id)
        if request is not None and not request.done:
            request.aborted = True
            cancel = rv_pb.CancelTransferRequest(key=tr_pb.TransferKey(transfer_id=request.key[0], attempt=request.key[1]), detail="prefill aborted")
            self.rpc.call("CancelTransfer", cancel)
            if not request.computing:
                del self.requests[req_id]

    def _source(self, request: PrefillRequest) -> SourceReady:
        blocks = tuple(range(-(-request.num_tokens // BLOCK_SIZE)))
        return SourceReady(request.req_id, request.key[0], request.key[1], request.req_id, request.decode_engine, (blocks,),
                           request.num_tokens, request.timeout_s, "", 0, 0, prompt_of(request.prompt_id, request.num_tokens))

    def _forward_starts(self, request: PrefillRequest, forward_s: float) -> None:
        """The last forward: each layer's KV is handed to the ranks as it is computed, the last with the source."""
        if request.aborted or self.requests.get(request.req_id) is not request:
            return
        request.computing = True
        ready = self._source(request)
        for rank in self.ranks:
            rank.handle(("computing", ready))
        layers = sorted(LAYERS)
        for i, layer in enumerate(layers[:-1]):
            self.proc.later(forward_s * (i + 1) / len(layers), self._layer_done, request, layer)
        self.proc.later(forward_s, self._prefill_done, request)

    def _layer_done(self, request: PrefillRequest, layer: int) -> None:
        if self.requests.get(request.req_id) is request:
            for rank in self.ranks:
                rank.handle(("layer", (request.key,), layer, None))

    def _prefill_done(self, request: PrefillRequest) -> None:
        if (request.aborted and not request.computing) or self.requests.get(request.req_id) is not request:
            return
        request.done = True
        ready = self._source(request)
        request.held_by = set(range(self.tp_size))
        for rank in self.ranks:
            rank.handle(("source", ready, None))
        if request.aborted:
            return  # its blocks were handed over with the forward: released by the ranks; the router has its answer
        report = sample.prefill_done_request(request.key[0], request.key[1], incarnation=self.incarnation, num_tokens=request.num_tokens,
                                             block_size=BLOCK_SIZE, timeout_s=request.timeout_s, decode_engine_id=request.decode_engine,
                                             client_request_id=request.req_id)
        self.rpc.call("ReportPrefillDone", report)
        self.sim.network.deliver(self.sim.router.proc, self.sim.router.prefill_answered, request.router_leg, True, lossy=False)

    def released(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            self.requests.pop(req_id, None)

    def kill(self, downtime: float) -> None:
        self.proc.kill()
        for request in self.requests.values():
            self.sim.network.deliver(self.sim.router.proc, self.sim.router.prefill_answered, request.router_leg, False, lossy=False)
        self.requests = {}
        self.ranks = []
        self.sim.world.at(self.sim.world.time + downtime, self._restart)

    def _restart(self) -> None:
        self.proc.revive()
        self.start()

    def holds(self) -> list[str]:
        out = []
        for rank in self.ranks:
            core = rank.core
            out += [f"source {k}" for k in core._sources] + [f"order {k}" for k in core._orders] + [f"job {k}" for k in core._jobs]
            out += [f"computing {k}" for k in core._computing]
        return out


@dataclass
class DecodeRequest:
    req_id: str
    key: tuple[str, int] | None
    router_leg: object
    deadline_bound: float  # true time by which its blocks must be released
    blocks: list[int]
    first_token: int = 0
    num_tokens: int = 0
    prompt_id: int = 0
    decoding: bool = False
    aborted: bool = False  # the router closed the leg (vLLM finished the request; blocks wait for the connector)


class DecodeEngine:
    def __init__(self, sim: Simulation):
        self.sim = sim
        self.proc = Process(sim.world, D_ENGINE, sim.world.rng.uniform(-1, 1) * sim.faults.skew_s)
        self.rpc = Rpc(sim, self.proc, D_ENGINE)
        self.incarnation_seq = 0
        self.start()

    def start(self) -> None:
        sim = self.sim
        self.incarnation_seq += 1
        self.incarnation = f"d-inc-{self.incarnation_seq}"
        self.memory = DecodeMemory(f"{D_ENGINE}/{self.incarnation}", sim.timing.decode_blocks, sim.violations)
        self.agent_name = f"{D_ENGINE}.{self.incarnation}.tp0"
        self.agent = DecodeAgent(self.agent_name, self.memory)
        sim.fabric.agents[self.agent_name] = self.agent
        self.waits = DecodeWaits(self.proc, sim.timing.hold_margin_s)
        self.consumer = ConsumerCore(self.agent, NoSpans(), self.proc)
        self.requests: dict[str, DecodeRequest] = {}
        self.ready = False
        self._stepping = False
        request = _rank_request(D_ENGINE, sample.DECODE, self.incarnation, 0, 1, sim.timing.registrar.default_lease_ttl_s)
        self.link = EngineLink(sim, self.proc, self.rpc, request, self._linked)

    def _linked(self) -> None:
        self.ready = True
        events = rv_pb.StreamTransferEventsRequest(engine_id=D_ENGINE, incarnation=self.incarnation)
        self.link.follow("events", events, lambda: None, self._on_event, lambda: None)

    def _on_event(self, message) -> None:
        self.waits.on_event(message.event)
        self.step()

    def leg(self, req_id: str, params: TransferParams | None, num_tokens: int, prompt_id: int, timeout_s: float, router_leg) -> None:
        """The router's decode leg arrives: vLLM allocates its blocks and the connector registers them."""
        if not self.ready:
            self._answer(router_leg, False, "decode engine not ready")
            return
        key = params.key if params is not None else None
        blocks = self.memory.allocate(req_id, key, -(-num_tokens // BLOCK_SIZE))
        if blocks is None:
            self._answer(router_leg, False, "no free KV blocks")
            return
        bound = self.sim.world.time + timeout_s + self.sim.timing.hold_margin_s + 1.0
        request = self.requests[req_id] = DecodeRequest(req_id, key, router_leg, bound, blocks, 0, num_tokens, prompt_id)
        wait = self.waits.admit(req_id, params, "" if params is not None else "bad request: unreadable kv_transfer_params", timeout_s, 0)
        if not wait.failure:
            self._register(request, params, timeout_s)
        self.step()

    def _register(self, request: DecodeRequest, params: TransferParams, timeout_s: float) -> None:
        registration = sample.destination_request(params.transfer_id, params.attempt, incarnation=self.incarnation, num_tokens=request.num_tokens,
                                                  block_size=BLOCK_SIZE, timeout_s=timeout_s, client_request_id=request.req_id)
        registration.destination.blocks[0].block_ids[:] = request.blocks
        registration.destination.prompt_digest = prompt_digest(prompt_of(request.prompt_id, request.num_tokens), request.num_tokens)
        registration.deadline.CopyFrom(timestamp(self.proc.wall() + timeout_s))
        registration.hold_margin.CopyFrom(duration(self.sim.timing.hold_margin_s))
        self.consumer.expect(DestinationReady(request.req_id, params.transfer_id, params.attempt, 0, request.num_tokens, 0, ""))
        self.waits.registered(request.req_id)
        key = params.key

        def done(response, error) -> None:
            if error is None:
                self.waits.registration_answered(key, response.state, response.fenced)
            elif not isinstance(error, Unavailable):
                self.waits.registration_refused(key, str(error), error.metadata.get("fenced") == "true")
            self.step()

        self.rpc.call("RegisterDestination", registration, done)

    def abort(self, req_id: str) -> None:
        request = self.requests.get(req_id)
        if request is None:
            return
        request.aborted = True
        if not request.decoding:
            self.waits.aborted(req_id)
            self.step()

    def step(self) -> None:
        """One engine step's connector work: results from the consumer, failures the waits decided."""
        self.consumer.step()
        finished, failed = self.consumer.take_results()
        for req_id in sorted(finished - failed):
            self._received(req_id)
        fails, cancels = self.waits.due()
        for key in cancels:
            self.rpc.call("CancelTransfer", rv_pb.CancelTransferRequest(key=tr_pb.TransferKey(transfer_id=key[0], attempt=key[1]), detail="decode gave up"))
        for req_id, reason in sorted(fails.items()):
            self.consumer.fail(req_id, reason)
        finished, failed = self.consumer.take_results()
        for req_id in sorted(failed):
            self._release(req_id, False, "failed")
        for req_id in sorted(finished - failed):
            self._received(req_id)
        if (len(self.waits) or self.consumer.busy) and not self._stepping:
            self._stepping = True
            self.proc.later(self.sim.timing.engine_step_s, self._idle_step)

    def _idle_step(self) -> None:
        self._stepping = False
        self.step()

    def _received(self, req_id: str) -> None:
        wait = self.waits.received(req_id)
        request = self.requests.get(req_id)
        if wait is None or request is None:
            return
        needed = (request.first_token, request.num_tokens, request.prompt_id, LAYERS)
        landed = self.memory.landed.get(req_id, {})
        producers = len(self.sim.prefill.ranks) if self.sim.prefill.ranks else 1
        if len(landed) < producers or any(tokens != needed for tokens in landed.values()):
            self.sim.violations.add("short-receive", f"{req_id} {request.key} reported received with WRITEs {landed} for tokens {needed}")
        if request.aborted:
            self._release(req_id, False, "aborted")
        else:
            request.decoding = True
            self.proc.later(self.sim.world.rng.uniform(*self.sim.timing.decode_time), self._decoded, request)

    def _decoded(self, request: DecodeRequest) -> None:
        self._release(request.req_id, not request.aborted, "decoded")

    def _release(self, req_id: str, ok: bool, why: str) -> None:
        request = self.requests.pop(req_id, None)
        if request is None:
            return
        if self.sim.world.time > request.deadline_bound:
            self.sim.violations.add("late-end", f"{req_id} {request.key} released its blocks {self.sim.world.time - request.deadline_bound + 1.0:.2f}s "
                                    "after its deadline + hold margin")
        self.memory.free(req_id)
        self._answer(request.router_leg, ok, why)

    def _answer(self, router_leg, ok: bool, why: str) -> None:
        self.sim.network.deliver(self.sim.router.proc, self.sim.router.decode_answered, router_leg, ok, why, lossy=False)

    def kill(self, downtime: float) -> None:
        self.proc.kill()
        self.memory.alive = False
        self.sim.fabric.agents.pop(self.agent_name, None)
        for request in self.requests.values():
            self._answer(request.router_leg, False, "decode engine died")
        self.requests = {}
        self.sim.world.at(self.sim.world.time + downtime, self._restart)

    def _restart(self) -> None:
        self.proc.revive()
        self.start()

    def holds(self) -> list[str]:
        return [f"block of {o.req_id}" for o in self.memory.owners.values()] + [f"wait {r}" for r in self.requests]


@dataclass
class ClientRequest:
    index: int
    transfer_id: str
    num_tokens: int
    timeout_s: float
    deadline: float  # true time
    attempt: int = 0
    answered: float | None = None
    ok: bool = False
    legs: dict = field(default_factory=dict)  # attempt -> Leg


@dataclass
class Leg:
    request: ClientRequest
    attempt: int
    p_req: str
    d_req: str
    prefill_ok: bool | None = None
    decode: tuple[bool, str] | None = None


class Router:
    """The router's policy: both legs at once, attempt + 1 on an engine fault while time remains, a deadline guard."""

    def __init__(self, sim: Simulation):
        self.sim = sim
        self.proc = Process(sim.world, "router", 0.0)
        self.rpc = Rpc(sim, self.proc, "router")
        self.requests: list[ClientRequest] = []

    def submit(self, request: ClientRequest, *, collide_with: ClientRequest | None = None, malformed: bool = False) -> None:
        self.requests.append(request)
        self.proc.later(request.timeout_s + self.sim.timing.router_slack_s, self._guard, request)
        self._attempt(request, collide_with=collide_with, malformed=malformed)

    def _attempt(self, request: ClientRequest, *, collide_with: ClientRequest | None = None, malformed: bool = False) -> None:
        request.attempt += 1
        leg = Leg(request, request.attempt, f"p-{request.index}-{request.attempt}", f"d-{request.index}-{request.attempt}")
        request.legs[request.attempt] = leg
        transfer_id, attempt = (collide_with.transfer_id, collide_with.attempt) if collide_with else (request.transfer_id, request.attempt)
        remaining = max(request.deadline - self.sim.world.time, 0.05)
        params = TransferParams("decode", transfer_id, attempt, P_ENGINE, remaining, "", leg.d_req)
        net = self.sim.network
        if not collide_with:
            net.deliver(self.sim.prefill.proc, self.sim.prefill.leg, leg.p_req, (transfer_id, attempt), request.num_tokens + self.sim.drift(request), request.index,
                        remaining, leg, lossy=False)
        else:
            leg.prefill_ok = True
        net.deliver(self.sim.decode.proc, self.sim.decode.leg, leg.d_req, None if malformed else params, request.num_tokens, request.index, remaining, leg,
                    lossy=False)

    def prefill_answered(self, leg: Leg, ok: bool) -> None:
        leg.prefill_ok = ok
        if not ok:
            self._leg_failed(leg, "prefill leg failed")

    def decode_answered(self, leg: Leg, ok: bool, why: str) -> None:
        request = leg.request
        leg.decode = (ok, why)
        if request.answered is not None or leg.attempt != request.attempt:
            return
        if ok:
            self._answer(request, True)
        else:
            self._leg_failed(leg, why)

    def _leg_failed(self, leg: Leg, why: str) -> None:
        request = leg.request
        if request.answered is not None or leg.attempt != request.attempt:
            return
        self._end_attempt(leg)
        if request.deadline - self.sim.world.time > 0.3 and request.attempt < 3:
            self.proc.later(0.05, self._attempt, request)
        else:
            self._answer(request, False)

    def _end_attempt(self, leg: Leg) -> None:
        key = tr_pb.TransferKey(transfer_id=leg.request.transfer_id, attempt=leg.attempt)
        self.rpc.call("CancelTransfer", rv_pb.CancelTransferRequest(key=key, detail="router ended the attempt"))
        self.sim.network.deliver(self.sim.decode.proc, self.sim.decode.abort, leg.d_req, lossy=False)
        self.sim.network.deliver(self.sim.prefill.proc, self.sim.prefill.abort, leg.p_req, lossy=False)

    def _guard(self, request: ClientRequest) -> None:
        if request.answered is None:
            self._end_attempt(request.legs[request.attempt])
            self._answer(request, False)

    def disconnect(self, request: ClientRequest) -> None:
        if request.answered is None and request.attempt:
            self._end_attempt(request.legs[request.attempt])
            self._answer(request, False)

    def _answer(self, request: ClientRequest, ok: bool) -> None:
        request.answered = self.sim.world.time
        request.ok = ok
        if request.answered > request.deadline + 1.0:
            self.sim.violations.add("late-end", f"client request {request.index} answered {request.answered - request.deadline:.2f}s after its deadline")


class Simulation:
    """One seeded schedule of requests and faults over the whole protocol."""

    def __init__(self, seed: int, timing: Timing | None = None):
        self.world = World(seed)
        # Choices of how the engines work (not faults) draw from their own generator, so
        # adding one leaves every schedule recorded before it (tests/sim/defects.py) as it was.
        self.variants = random.Random(f"kvpush-sim-variants-{seed}")
        self.timing = timing or Timing()
        self.faults = Faults.draw(self.world.rng, self.timing.broker.max_clock_skew_s)
        self.violations = Violations(clock=self.world)
        self.network = Network(self.world, self.faults)
        self.fabric = Fabric()
        self._drifted: set[int] = set()
        self.cp = ControlPlane(self)
        self.prefill = PrefillEngine(self)
        self.decode = DecodeEngine(self)
        self.router = Router(self)

    def drift(self, request: ClientRequest) -> int:
        """Tokens the prefill engine computes beyond (negative: short of) what the decode engine registers."""
        return -request.num_tokens // 2 if request.index in self._drifted else 0

    def run(self, max_events: int = 200_000) -> Violations:
        world, rng, timing = self.world, self.world.rng, self.timing
        arrivals = 3.0
        requests = [ClientRequest(i, f"t{i}", rng.choice((16, 40, 64, 100)), rng.uniform(*timing.request_timeout), 0.0) for i in range(rng.randint(3, 8))]
        if rng.random() < 0.2:
            self._drifted.add(rng.randrange(len(requests)))
        for request in requests:
            start = rng.uniform(0.3, arrivals)
            request.deadline = start + request.timeout_s
            world.at(start, self.router.proc.later, 0.0, self.router.submit, request)
        self._schedule_faults(requests, arrivals)
        world.run(arrivals + timing.request_timeout[1] + 8.0, max_events)
        self._check_quiet(requests)
        return self.violations

    def _schedule_faults(self, requests: list[ClientRequest], horizon: float) -> None:
        world, rng, f = self.world, self.world.rng, self.faults
        when = lambda: rng.uniform(0.2, horizon + 1.0)  # noqa: E731
        for _ in range(f.stream_resets):
            world.at(when(), self._reset_streams)
        for _ in range(f.lease_outages):
            world.at(when(), self._cut, rng.choice((self.prefill, self.decode)), rng.uniform(0.5, 2.5))
        for _ in range(f.pauses):
            world.at(when(), self._pause, rng.uniform(0.2, 2.5))
        for _ in range(f.kills):
            world.at(when(), self._kill, rng.choice(("prefill", "decode", "control-plane")), rng.uniform(0.1, 1.5))
        for _ in range(f.disconnects):
            world.at(when(), self.router.proc.later, 0.0, self.router.disconnect, rng.choice(requests))
        for i in range(f.collisions):
            victim = rng.choice(requests)
            twin = ClientRequest(1000 + i, f"c{i}", victim.num_tokens, victim.timeout_s, 0.0)
            at = rng.uniform(0.3, horizon + 0.5)
            twin.deadline = at + twin.timeout_s
            world.at(at, self._collide, twin, victim)
        for i in range(f.malformed):
            bad = ClientRequest(2000 + i, f"m{i}", 40, 1.0, 0.0)
            at = rng.uniform(0.3, horizon)
            bad.deadline = at + bad.timeout_s
            world.at(at, self.router.proc.later, 0.0, lambda b=bad: self.router.submit(b, malformed=True))

    def _reset_streams(self) -> None:
        rng = self.world.rng
        self.cp.break_streams(rng.choice((self.prefill.proc, self.decode.proc, None)), rng.uniform(0.0, 1.0))

    def _collide(self, twin: ClientRequest, victim: ClientRequest) -> None:
        if victim.attempt:
            self.router.submit(twin, collide_with=victim)

    def _cut(self, engine, seconds: float) -> None:
        """A network cut between an engine and the control plane (NIXL stays up)."""
        engine.rpc.cut_until = self.world.time + seconds
        self.cp.break_streams(engine.proc, self.world.rng.uniform(0.0, seconds))

    def _pause(self, seconds: float) -> None:
        self.prefill.proc.paused_until = self.world.time + seconds

    def _kill(self, which: str, downtime: float) -> None:
        {"prefill": self.prefill, "decode": self.decode, "control-plane": self.cp}[which].kill(downtime)

    def _check_quiet(self, requests: list[ClientRequest]) -> None:
        for request in self.router.requests:
            if request.answered is None:
                self.violations.add("hung", f"client request {request.index} never answered")
        left = self.prefill.holds() + self.decode.holds()
        if self.cp.proc.alive and self.cp.broker.unsettled_attempts:
            left.append(f"{self.cp.broker.unsettled_attempts} unsettled attempts at the broker")
        if len(self.decode.waits):
            left.append(f"{len(self.decode.waits)} decode waits")
        if left:
            self.violations.add("leak", "; ".join(left[:8]))
