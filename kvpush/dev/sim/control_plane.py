# SPDX-License-Identifier: Apache-2.0
"""The simulated control plane (registrar and broker in one process) and its clients' side of it.

Unary calls may be lost, doubled, delayed or time out (Rpc retries them as
the kvpush client does); streams deliver in order and can break (EngineLink
reopens them, and keeps an engine rank registered, as ControlSession does).

The broker is one member of a shard map (MapMembership), so it can doubt its
membership lease (an etcd election): it then stops serving, ends its live
attempts BROKER_SHARD_LOST and refuses everything, until it is sure again.
An engine sends a report it refused that way again after a pause, as
connector/report_routing.py does.

In a sharded schedule the broker's calls go instead to the members of
shards.py, each to its transfer's owner in the caller's map (Rpc.call
follows a NOT_SHARD_OWNER answer to the owner it names); the control
plane then serves the registrar alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvpush.connector.report_routing import MAX_REDIRECTS, RETRY_FIRST_S, RETRY_MAX_S
from kvpush.dev import sample_engines as sample
from kvpush.dev.sim.deployment import BLOCK_SIZE, LAYERS, SLIDING_LAYERS, WINDOW
from kvpush.dev.sim.world import Process, Stream
from kvpush.engine.v1 import engine_pb2
from kvpush.errors import KvpushError, Reason, Unavailable
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.services.broker.core import BrokerCore
from kvpush.services.broker.membership import MapMembership
from kvpush.services.registrar.core import RegistrarCore
from kvpush.services.registrar.directory import EngineWatch

if TYPE_CHECKING:
    from kvpush.dev.sim.shard_maps import ClientMap
    from kvpush.dev.sim.simulation import Simulation
    from kvpush.services.broker.mailboxes import Subscription

BROKER_MEMBER = "broker-0"
# An engine's per-request messages (EngineReports items in the connector): a refusal by a member that is not serving
# (BROKER_SHARD_LOST) sends them again with the connector's pauses (RETRY_FIRST_S doubling to RETRY_MAX_S) while the
# call has time left.
REPORTS = frozenset(("RegisterDestination", "ReportPrefillDone", "ReportWriteResult", "CancelTransfer"))


class Rpc:
    """Unary calls from a client process to the control plane, with the kvpush client's timeout and retries."""

    def __init__(self, sim: Simulation, client: Process, caller: str):
        self.sim = sim
        self.client = client
        self.caller = caller
        self.cut_until = 0.0  # a network cut between this client and the control plane
        self.client_map: ClientMap | None = None  # a sharded broker's map as this client sees it

    def call(self, method: str, request, on_done=None, *, tries: int | None = None, member_for=None, on_route=None) -> None:
        """on_done(response, error); error is Unavailable when no answer came in time after every try.

        With a sharded broker a broker call goes to the transfer's owner in this client's map, or to member_for(),
        when it names a member of the map (a write result goes to the member whose order it answers); on_route(member)
        is told where each try went.
        """
        state: dict[str, Any] = {"done": False, "resends": 0, "refusal": None, "redirect": None, "redirects": 0}
        tries = tries or self.sim.timing.rpc_tries
        give_up_at = self.sim.world.time + tries * self.sim.timing.rpc_timeout_s
        resends_refused = method in REPORTS and self.caller != "router"
        sharded = self.sim.shards is not None and method in REPORTS
        # A member that is not serving applied nothing; nor did one that named no owner to follow: send again later.
        resend_reasons = (Reason.BROKER_SHARD_LOST, Reason.NOT_SHARD_OWNER) if sharded else (Reason.BROKER_SHARD_LOST,)

        def finish(response, error, *, last: bool = False) -> None:
            if state["done"]:
                return
            reason = getattr(error, "reason", None)
            if not last and sharded and reason == Reason.NOT_SHARD_OWNER and self._redirect(state, error):
                send()
                return
            if not last and resends_refused and error is not None and reason in resend_reasons:
                delay = min(RETRY_FIRST_S * 2 ** state["resends"], RETRY_MAX_S)
                if self.sim.world.time + delay < give_up_at:
                    state["resends"] += 1
                    state["refusal"] = error
                    self.client.later(delay, send)
                    return
            state["done"] = True
            if on_done is not None:
                on_done(response, error)

        def send() -> None:
            if state["done"] or self.sim.world.time < self.cut_until:
                return
            if not sharded:
                self.sim.cp.receive(self, method, request, finish)
                return
            client_map, shards = self.client_map, self.sim.shards
            assert client_map is not None and shards is not None, "a sharded call needs the client's map"
            name, state["redirect"] = state["redirect"], None
            preferred = member_for() if member_for is not None else None
            name = name or (preferred if preferred in client_map.members else client_map.owner(request.key.transfer_id))
            member = shards.member(name) if name else None
            if member is None:
                return  # no member in the map: no answer, as from a broker that cannot be reached
            if on_route is not None:
                on_route(name)
            member.receive(self, method, request, finish)

        def attempt(n: int) -> None:
            if state["done"]:
                return
            send()
            if n + 1 < tries:
                self.client.later(self.sim.timing.rpc_timeout_s, attempt, n + 1)
            else:
                self.client.later(self.sim.timing.rpc_timeout_s, lambda: finish(None, state["refusal"] or Unavailable(f"{method}: no answer"), last=True))

        attempt(0)

    def _redirect(self, state: dict, error) -> bool:
        """Follows a NOT_SHARD_OWNER answer to the owner it names, a few times (ShardedBrokerClient, ReportRouter)."""
        owner = error.metadata.get("owner_member_id", "")
        shards = self.sim.shards
        if not owner or state["redirects"] >= (1 if self.caller == "router" else MAX_REDIRECTS) or shards is None or shards.member(owner) is None:
            return False
        state["redirects"] += 1
        state["redirect"] = owner
        return True

    def reply(self, finish, response, error) -> None:
        if self.sim.world.time >= self.cut_until:
            self.sim.network.deliver(self.client, finish, response, error)


class ControlPlane:
    """Registrar and broker in one process (the embedded default); a kill loses all of their state."""

    def __init__(self, sim: Simulation):
        self.sim = sim
        self.proc = Process(sim.world, "control-plane", sim.world.rng.uniform(-1, 1) * sim.faults.skew_s)
        self.streams: list[tuple[Stream, Subscription | EngineWatch, str]] = []  # (stream, its broker subscription or engine watch, kind)
        self._lease_seq = 0
        self.start()

    def start(self) -> None:
        self.registrar = RegistrarCore(self.sim.timing.registrar, self.proc, new_lease_id=self._new_lease_id)
        if self.sim.shards is not None:  # the broker members follow the registrar's engines
            self.registrar.add_removal_listener(self.sim.shards.engine_removed)
        self.lease_sure = True  # the broker member surely holds its membership lease
        self.membership = MapMembership(BROKER_MEMBER, lambda: self.lease_sure)
        self.membership.update({BROKER_MEMBER: self.proc.name}, 1)
        self.broker = BrokerCore(self.registrar, self.sim.timing.broker, self.proc, membership=self.membership)
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
            subscription: Subscription | EngineWatch
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
            active = not subscription.outbox.closed if isinstance(subscription, EngineWatch) else subscription.active  # kind "watch"
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

    def doubt_lease(self, seconds: float) -> None:
        """The member cannot be sure of its lease for a while (etcd electing a leader), then is again, its state kept."""
        generation = self.proc.generation
        self._set_lease_sure(False)
        self.sim.world.at(self.sim.world.time + seconds, self._sure_again, generation)

    def _sure_again(self, generation: int) -> None:
        if self.proc.alive and self.proc.generation == generation:
            self._set_lease_sure(True)

    def _set_lease_sure(self, sure: bool) -> None:
        self.lease_sure = sure
        self.membership.notify()  # the core acts on it: ends or resumes serving
        self._tick()

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


def rank_request(engine_id: str, role: engine_pb2.EngineRole, incarnation: str, tp_rank: int, tp_size: int, ttl: float, pp_rank: int = 0,
                 pp_size: int = 1, hybrid: bool = False) -> reg_pb.RegisterEngineRankRequest:
    request = sample.rank_request(engine_id, role, incarnation=incarnation, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
                                  num_layers=len(LAYERS), lease_ttl_s=ttl, block_size=BLOCK_SIZE)
    if hybrid:  # the sliding-window layers move to a group of their own
        layout = request.layout
        layout.groups.add(group_index=1, kind=engine_pb2.KV_CACHE_GROUP_KIND_SLIDING_WINDOW, block_size=BLOCK_SIZE,
                          num_blocks=layout.groups[0].num_blocks, sliding_window=WINDOW)
        for region in layout.regions:
            region.group_index = 1 if region.layer_index in SLIDING_LAYERS else 0
    request.nixl.agent_name = f"{engine_id}.{incarnation}.tp{tp_rank}" + (f".pp{pp_rank}" if pp_size > 1 else "")
    request.nixl.agent_metadata = request.nixl.agent_name.encode()
    return request
