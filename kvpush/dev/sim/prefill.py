# SPDX-License-Identifier: Apache-2.0
"""The simulated prefill engine: vLLM's scheduling of prefills (layer by layer when layer-progressive) around each rank's ProducerCore.

A pipeline-parallel engine's stages each hold their layers; the first stage
finishes its share of the last forward first and reports the prefill done
(as the worker does), the later stage finishes at the forward's end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpush.connector import write_plans
from kvpush.connector.handoff import SourceReady
from kvpush.connector.producer import ProducerCore
from kvpush.connector.write_plans import LocalLayout, WritePlan
from kvpush.dev import sample_engines as sample
from kvpush.dev.sim.control_plane import EngineLink, Rpc, rank_request
from kvpush.dev.sim.deployment import BLOCK_SIZE, D_ENGINE, LAYERS, P_ENGINE, NoSpans, groups_of, prompt_id_of, prompt_of, stage_layers
from kvpush.dev.sim.nixl import ProducerTransport, SimPlan
from kvpush.dev.sim.shard_maps import ClientMap, MemberStreams
from kvpush.dev.sim.world import Process
from kvpush.engine.v1 import engine_pb2
from kvpush.layout import heads
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb

if TYPE_CHECKING:
    from kvpush.dev.sim.simulation import Simulation


class PrefillRank:
    def __init__(self, engine: PrefillEngine, tp_rank: int, pp_rank: int = 0):
        self.engine = engine
        sim = engine.sim
        self.transport = ProducerTransport(engine.proc, sim.fabric, f"{P_ENGINE}.{engine.incarnation}.tp{tp_rank}.pp{pp_rank}",
                                           sim.timing.write_time, sim.faults.stuck_writes, sim.violations,
                                           failed_posts=sim.faults.failed_posts)
        self.layers = stage_layers(pp_rank, engine.pp_size)
        kv_layout = engine_pb2.KvLayout(total_kv_heads=2, regions=[engine_pb2.KvRegion(layer_index=layer) for layer in sorted(self.layers)])
        layout = LocalLayout(kv_layout, tp_rank, engine.tp_size, 0, pp_rank, engine.pp_size)
        self.core = ProducerCore(self.transport, layout, P_ENGINE, self._report, NoSpans(), engine.proc, plan_writes=self._plan)
        self._stream = 0
        self._next_step = float("inf")
        request = rank_request(P_ENGINE, sample.PREFILL, engine.incarnation, tp_rank, engine.tp_size, sim.timing.registrar.default_lease_ttl_s,
                               pp_rank, engine.pp_size, sim.hybrid)
        self.link = EngineLink(sim, engine.proc, engine.rpc, request, self._linked)

    def _linked(self) -> None:
        local = self.core.local
        orders = rv_pb.StreamWriteOrdersRequest(engine_id=P_ENGINE, incarnation=self.engine.incarnation, tp_rank=local.tp_rank, pp_rank=local.pp_rank,
                                                early_orders=True)
        if self.engine.sim.shards is None:
            self.link.follow("orders", orders, self._opened, self._on_order_message, self._lost)
        else:  # one order stream per broker member of the engine's map: each orders the transfers it owns
            MemberStreams(self.engine.sim, self.engine.map, "orders", orders, self._member_opened, self._on_member_message, self._member_lost)
        watch = reg_pb.WatchEnginesRequest(role=engine_pb2.ENGINE_ROLE_DECODE)
        self.link.follow("watch", watch, lambda: None, lambda m: self.handle(("engine", m)), lambda: None)

    def _opened(self) -> None:
        self._stream += 1
        self.handle(("stream_opened", self._stream))

    def _on_order_message(self, message) -> None:
        self.handle(("stream", self._stream, message))

    def _lost(self) -> None:
        self.handle(("stream_lost", self._stream))

    def _member_opened(self, member: str) -> int:
        self._stream += 1
        self.handle(("stream_opened", self._stream, member))
        return self._stream

    def _on_member_message(self, stream: int, message) -> None:
        self.handle(("stream", stream, message))

    def _member_lost(self, stream: int) -> None:
        self.handle(("stream_lost", stream))

    def _plan(self, source, order, peer, layers: frozenset[int] | None = None) -> list[WritePlan]:
        dest = order.order.destination
        end = dest.first_token + min(dest.num_tokens, source.ready.num_tokens - dest.first_token)
        wanted = self.layers if layers is None else layers
        segments = []
        # The bytes a WRITE moves, per KV cache group, are what the source holds of the group's range (a
        # sliding-window group's starts at its window), which prompt's KV they are, and of which layers.
        for group, group_layers, _ in groups_of(self.engine.sim.hybrid):
            blocks = next(b for b in dest.blocks if b.group_index == group)
            first = max(blocks.first_token, dest.first_token)
            if wanted & group_layers:
                segments.append((group, tuple(blocks.block_ids), (first, end - first, prompt_id_of(source.ready.prompt), wanted & group_layers)))
        local = self.core.local
        routes = heads.routes(heads.even_split(2, local.tp_size), heads.even_split(2, 1))
        return [WritePlan(d_rank, SimPlan(tuple(segments)), write_plans.notifications_expected(local, d_rank, routes))
                for d_rank in order.order.decode_tp_ranks]

    def _report(self, request) -> None:
        # Sharded, the answer goes to the member whose order it answers: it holds the attempt, owner or not.
        key = (request.key.transfer_id, request.key.attempt)
        self.engine.rpc.call("ReportWriteResult", request, member_for=lambda: self.core.answer_member(key))

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


class PrefillEngine:
    def __init__(self, sim: Simulation):
        self.sim = sim
        self.tp_size = sim.world.rng.choice((1, 2))
        self.proc = Process(sim.world, P_ENGINE, sim.world.rng.uniform(-1, 1) * sim.faults.skew_s)
        self.rpc = Rpc(sim, self.proc, P_ENGINE)
        self.incarnation_seq = 0
        self.requests: dict[str, PrefillRequest] = {}
        self.progressive = sim.variants.random() < 0.5  # layer-progressive push
        self.pp_size = sim.variants.choice((1, 2))  # pipeline stages
        self.start()

    def start(self) -> None:
        self.incarnation_seq += 1
        self.incarnation = f"p-inc-{self.incarnation_seq}"
        self.requests = {}
        if self.sim.shards is not None:  # a new session follows the map afresh
            self.map = self.rpc.client_map = ClientMap(self.sim, self.proc, self.rpc)
        self.ranks = [PrefillRank(self, tp, pp) for pp in range(self.pp_size) for tp in range(self.tp_size)]

    def layers_of(self, producer: int) -> frozenset[int]:
        """The layers a producer rank (numbered stage-major, as its notifications say) writes."""
        return stage_layers(producer // self.tp_size, self.pp_size)

    def leg(self, req_id: str, key, num_tokens: int, prompt_id: int, timeout_s: float, router_leg) -> None:
        """The router's prefill leg arrives."""
        request = PrefillRequest(req_id, key, num_tokens, prompt_id, D_ENGINE, timeout_s, router_leg)
        self.requests[req_id] = request
        rng = self.sim.world.rng
        prefill_s = rng.uniform(*self.sim.timing.prefill_time)
        if self.progressive:  # earlier chunks have no KV to push: the last forward starts somewhere in the prefill
            forward_s = prefill_s * self.sim.variants.uniform(0.1, 0.7)
            self.proc.later(prefill_s - forward_s, self._forward_starts, request, forward_s)
        else:  # the last forward is the second half (no draw: schedules recorded before stay as they were)
            self.proc.later(prefill_s / 2, self._whole_forward_starts, request)
            for stage in range(self.pp_size):  # the forward passes the stages in turn
                self.proc.later(prefill_s / 2 * (1 + (stage + 1) / self.pp_size), self._stage_done, request, stage)

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
        groups = groups_of(self.sim.hybrid)  # every group's blocks cover the prompt on P (vLLM's null blocks below a window are not read)
        return SourceReady(request.req_id, request.key[0], request.key[1], request.req_id, request.decode_engine, (blocks,) * len(groups),
                           request.num_tokens, request.timeout_s, "", 0, 0, prompt_of(request.prompt_id, request.num_tokens))

    def _forward_starts(self, request: PrefillRequest, forward_s: float) -> None:
        """The last forward: each layer's KV is handed to the ranks as it is computed, the last with the source."""
        if not self._announce_forward(request, whole=False):
            return
        layers = sorted(LAYERS)
        for i, layer in enumerate(layers[:-1]):
            self.proc.later(forward_s * (i + 1) / len(layers), self._layer_done, request, layer)
        for stage in range(self.pp_size):  # a stage is done with its last layer
            self.proc.later(forward_s * (layers.index(max(stage_layers(stage, self.pp_size))) + 1) / len(layers), self._stage_done, request, stage)

    def _whole_forward_starts(self, request: PrefillRequest) -> None:
        """The last forward of a prefill written whole at its end: the ranks make its WRITE meanwhile."""
        self._announce_forward(request, whole=True)

    def _announce_forward(self, request: PrefillRequest, whole: bool) -> bool:
        """Tells the ranks which source the last forward computes; False if the request went away first."""
        if request.aborted or self.requests.get(request.req_id) is not request:
            return False
        request.computing = True
        ready = self._source(request)
        for rank in self.ranks:
            rank.handle(("computing", ready, whole))
        return True

    def _layer_done(self, request: PrefillRequest, layer: int) -> None:
        if self.requests.get(request.req_id) is request:
            for rank in self.ranks:
                if layer in rank.layers:
                    rank.handle(("layer", (request.key,), layer, None))

    def _stage_done(self, request: PrefillRequest, stage: int) -> None:
        """A stage's share of the last forward ends: its ranks hold the source. The first stage reports the prefill done, the last answers."""
        first, last = stage == 0, stage == self.pp_size - 1
        if first and ((request.aborted and not request.computing) or self.requests.get(request.req_id) is not request):
            return
        if not first and not request.computing:
            return  # the forward never ran
        ready = self._source(request)
        for rank in self.ranks:
            if rank.core.local.pp_rank == stage:
                rank.handle(("source", ready, None))
        request.done = request.done or last
        if request.aborted:
            return  # its blocks were handed over with the forward: released by the ranks; the router has its answer
        if last:
            self.sim.network.deliver(self.sim.router.proc, self.sim.router.prefill_answered, request.router_leg, True, lossy=False)
        if not first:
            return
        report = sample.prefill_done_request(request.key[0], request.key[1], incarnation=self.incarnation, num_tokens=request.num_tokens,
                                             block_size=BLOCK_SIZE, timeout_s=request.timeout_s, decode_engine_id=request.decode_engine,
                                             client_request_id=request.req_id)
        for group, _, _ in groups_of(self.sim.hybrid)[1:]:
            report.source.blocks.add(group_index=group, block_ids=report.source.blocks[0].block_ids)
        self.rpc.call("ReportPrefillDone", report)

    def released(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is not None and request.done:  # else a later stage still computes it
                del self.requests[req_id]

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
            out += [f"made WRITE {w.key} to {w.dest}" for w in rank.transport.made.values()]
        return out
