# SPDX-License-Identifier: Apache-2.0
"""Every protocol defect of the fencing issue, re-injected: the simulation (or, for one, its exact interleaving) catches it; without it the same seed passes."""

from __future__ import annotations

import pytest
from defects import SIMULATED, aborted_registration_frees

from kvpush.clock import ManualClock
from kvpush.connector.decode_waits import DecodeWaits
from kvpush.connector.params import TransferParams
from kvpush.dev import sample_engines as sample
from kvpush.dev.sim.simulation import Simulation
from kvpush.errors import KvpushError
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.services.broker.config import BrokerConfig
from kvpush.services.broker.core import BrokerCore
from kvpush.services.registrar.config import RegistrarConfig
from kvpush.services.registrar.core import RegistrarCore


@pytest.mark.parametrize("defect", SIMULATED, ids=lambda d: f"defect-{d.number}")
def test_the_simulation_finds_the_defect_and_the_fix_holds(defect):
    for seed in defect.seeds:
        with defect.patch():
            found = Simulation(seed, defect.timing, defect.members).run()
        assert defect.expected in found.kinds, (seed, found.items[:3])
        fixed = Simulation(seed, defect.timing, defect.members).run()
        assert not fixed, (seed, fixed.items[:3])


def test_defect_2_a_superseded_registration_retry_never_frees_blocks_an_order_can_reach():
    """D registers attempt 1 (P gets an early order), its answer is lost, attempt 2 supersedes it, D retries attempt 1."""
    clock = ManualClock()
    registrar = RegistrarCore(RegistrarConfig(default_lease_ttl_s=60.0), clock)
    config = BrokerConfig()
    broker = BrokerCore(registrar, config, clock)
    for engine, role in (("prefill-0", sample.PREFILL), ("decode-0", sample.DECODE)):
        registrar.register(sample.rank_request(engine, role))
    clock.advance(config.startup_grace_s)
    orders = broker.subscribe_producer(
        rv_pb.StreamWriteOrdersRequest(engine_id="prefill-0", incarnation="inc-1", early_orders=True), "prefill-0"
    )

    def outcome_of_retry() -> bool:
        waits = DecodeWaits(clock, hold_margin_s=5.0)
        params = TransferParams("decode", "t", 1, "prefill-0", 30.0, "", "r1")
        waits.admit("r1", params, "", 30.0, 0)
        waits.registered("r1")
        try:
            answer = broker.register_destination(sample.destination_request("t", 1, first_block=0), "decode-0")
            waits.registration_answered(("t", 1), answer.state, answer.fenced)
        except KvpushError as error:
            waits.registration_refused(("t", 1), str(error), error.metadata.get("fenced") == "true")
        fails, _ = waits.due()
        return "r1" in fails  # reported failed = its blocks handed back to vLLM

    broker.register_destination(sample.destination_request("t", 1, first_block=0), "decode-0")  # the first try, whose answer is lost
    assert [m.WhichOneof("message") for m in orders.outbox.drain()] == ["order"]  # P holds an early order for attempt 1
    broker.register_destination(sample.destination_request("t", 2, first_block=10), "decode-0")  # the router reissued
    assert not outcome_of_retry()  # fixed: the retry learns attempt 1 ended but is not fenced: the blocks stay
    with aborted_registration_frees():
        assert outcome_of_retry()  # the defect: ABORTED read as "nothing held" frees them under P's order
