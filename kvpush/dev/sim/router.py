# SPDX-License-Identifier: Apache-2.0
"""The simulated router: client requests, both legs at once, a retry policy and a deadline guard."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpush.connector.params import TransferParams
from kvpush.dev.sim.control_plane import Rpc
from kvpush.dev.sim.deployment import P_ENGINE
from kvpush.dev.sim.shard_maps import ClientMap
from kvpush.dev.sim.world import Process
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb

if TYPE_CHECKING:
    from kvpush.dev.sim.simulation import Simulation


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
        if sim.shards is not None:
            self.rpc.client_map = ClientMap(sim, self.proc, self.rpc)
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
