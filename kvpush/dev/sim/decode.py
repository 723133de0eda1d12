# SPDX-License-Identifier: Apache-2.0
"""The simulated decode engine: vLLM's block allocation and decoding around its ConsumerCore and DecodeWaits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpush.clock import duration, timestamp
from kvpush.connector.consumer import ConsumerCore
from kvpush.connector.decode_waits import EVENT_TYPES, DecodeWaits
from kvpush.connector.handoff import DestinationReady, prompt_digest
from kvpush.connector.params import TransferParams
from kvpush.dev import sample_engines as sample
from kvpush.dev.sim.control_plane import EngineLink, Rpc, rank_request
from kvpush.dev.sim.deployment import BLOCK_SIZE, D_ENGINE, LAYERS, NoSpans, groups_of, prompt_of
from kvpush.dev.sim.nixl import DecodeAgent, DecodeMemory
from kvpush.dev.sim.shard_maps import ClientMap, MemberStreams
from kvpush.dev.sim.world import Process
from kvpush.errors import Unavailable
from kvpush.layout import geometry
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb

if TYPE_CHECKING:
    from kvpush.dev.sim.simulation import Simulation


@dataclass
class DecodeRequest:
    req_id: str
    key: tuple[str, int] | None
    router_leg: object
    deadline_bound: float  # true time by which its blocks must be released
    blocks: list[list[int]]  # per KV cache group, in groups_of order: the group's blocks, from its first token
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
        if sim.shards is not None:  # a new session follows the map afresh
            self.map = self.rpc.client_map = ClientMap(sim, self.proc, self.rpc)
        self._stepping = False
        request = rank_request(D_ENGINE, sample.DECODE, self.incarnation, 0, 1, sim.timing.registrar.default_lease_ttl_s, hybrid=sim.hybrid)
        self.link = EngineLink(sim, self.proc, self.rpc, request, self._linked)

    def _linked(self) -> None:
        self.ready = True
        events = rv_pb.StreamTransferEventsRequest(engine_id=D_ENGINE, incarnation=self.incarnation, event_types=EVENT_TYPES)
        if self.sim.shards is None:
            self.link.follow("events", events, lambda: None, self._on_event, lambda: None)
            return
        MemberStreams(self.sim, self.map, "events", events, lambda member: member, lambda _member, message: self._on_event(message), lambda _member: None)
        self.map.listeners.append(self._members_changed)

    def _members_changed(self, added: set[str], removed: set[str]) -> None:
        """A member left this engine's map: the requests registered with it fail, their blocks held (DecodeWaits.member_left)."""
        for member in sorted(removed):
            self.waits.member_left(member, frozenset(self.map.members))
        if removed:
            self.step()

    def _on_event(self, message) -> None:
        self.waits.on_event(message.event)
        self.step()

    def leg(self, req_id: str, params: TransferParams | None, num_tokens: int, prompt_id: int, timeout_s: float, router_leg) -> None:
        """The router's decode leg arrives: vLLM allocates its blocks and the connector registers them."""
        if not self.ready:
            self._answer(router_leg, False, "decode engine not ready")
            return
        key = params.key if params is not None else None
        # A sliding-window group gets blocks for the window its first decode step reads (vLLM's null block stands before it).
        starts = [geometry.window_first_token(0, num_tokens, BLOCK_SIZE, window) for _, _, window in groups_of(self.sim.hybrid)]
        counts = [-(-num_tokens // BLOCK_SIZE) - start // BLOCK_SIZE for start in starts]
        allocated = self.memory.allocate(req_id, key, sum(counts))
        if allocated is None:
            self._answer(router_leg, False, "no free KV blocks")
            return
        blocks = [allocated[sum(counts[:g]):sum(counts[:g + 1])] for g in range(len(counts))]
        bound = self.sim.world.time + timeout_s + self.sim.timing.hold_margin_s + 1.0
        request = self.requests[req_id] = DecodeRequest(req_id, key, router_leg, bound, blocks, 0, num_tokens, prompt_id)
        wait = self.waits.admit(req_id, params, "" if params is not None else "bad request: unreadable kv_transfer_params", timeout_s, 0)
        if not wait.failure:
            assert params is not None, "without parameters the wait carries its refusal"
            self._register(request, params, timeout_s)
        self.step()

    def _register(self, request: DecodeRequest, params: TransferParams, timeout_s: float) -> None:
        registration = sample.destination_request(params.transfer_id, params.attempt, incarnation=self.incarnation, num_tokens=request.num_tokens,
                                                  block_size=BLOCK_SIZE, timeout_s=timeout_s, client_request_id=request.req_id)
        registration.destination.blocks[0].block_ids[:] = request.blocks[0]
        for (group, _, window), blocks in list(zip(groups_of(self.sim.hybrid), request.blocks))[1:]:
            first = geometry.window_first_token(0, request.num_tokens, BLOCK_SIZE, window)
            registration.destination.blocks.add(group_index=group, block_ids=blocks, first_token=first)
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

        self.rpc.call("RegisterDestination", registration, done, on_route=lambda member: self.waits.routed(key, member))

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
        if not self._complete(request):
            landed = self.memory.landed.get(req_id, {})
            self.sim.violations.add("short-receive", f"{req_id} {request.key} reported received with WRITEs {landed} for tokens "
                                    f"[{request.first_token}, {request.first_token + request.num_tokens}) of prompt {request.prompt_id}")
        if request.aborted:
            self._release(req_id, False, "aborted")
        else:
            request.decoding = True
            self.proc.later(self.sim.world.rng.uniform(*self.sim.timing.decode_time), self._decoded, request)

    def _complete(self, request: DecodeRequest) -> bool:
        """Whether every producer rank wrote what the first decode step reads, of this prompt, each its stage's layers of each group.

        A full group needs exactly the registered tokens; a sliding-window
        group at least the window of the token after them (a query's own
        included), whatever the registration asked for.
        """
        landed = self.memory.landed.get(request.req_id, {})
        prefill = self.sim.prefill
        end = request.first_token + request.num_tokens
        covered: set[int] = set()
        for producer in range(prefill.tp_size * prefill.pp_size):  # its ranks, also while it is down
            for group, group_layers, window in groups_of(self.sim.hybrid):
                layers = prefill.layers_of(producer) & group_layers
                if not layers:
                    continue
                tokens = landed.get((producer, group))
                if tokens is None or tokens[2:] != (request.prompt_id, layers) or tokens[0] + tokens[1] != end:
                    return False
                needed_from = max(request.first_token, end + 1 - window) if window else request.first_token
                if tokens[0] > needed_from or (not window and tokens[0] != request.first_token):
                    return False
                covered |= layers
        return covered == LAYERS

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
