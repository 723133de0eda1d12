# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""Writes the golden wire files of the kvpush v1 contract: golden/*.binpb and golden/expected.json.

Golden files freeze what v1 messages look like on the wire, so that
test_golden.py fails when a change to protos/ would make today's peers
misread tomorrow's (or the reverse). Regenerate them only when a new contract
version is cut (a new major package, e.g. kvpush.*.v2), never to make a
failing golden test pass: that failure is the point. Hence --force.

    python tests/contract/make_golden.py --force
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from google.protobuf import duration_pb2, json_format, timestamp_pb2
from google.protobuf.message import Message

from kvpush.engine.v1 import engine_pb2 as engine
from kvpush.registrar.v1 import registrar_service_pb2 as registrar
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rendezvous
from kvpush.rendezvous.v1 import transfer_pb2 as transfer

GOLDEN_DIR = pathlib.Path(__file__).resolve().parent / "golden"
EXPECTED_FILE = GOLDEN_DIR / "expected.json"

KEY = transfer.TransferKey(transfer_id="tr-7f3a9c", attempt=2)
CLIENT_REQUEST_ID = "cmpl-4b1d2e"
PREFILL_INCARNATION = "8d3f6c1e-2a4b-4c5d-9e7f-0a1b2c3d4e5f"
DECODE_INCARNATION = "1f2e3d4c-5b6a-4789-8abc-def012345678"


def _time(seconds: int, nanos: int = 0) -> timestamp_pb2.Timestamp:
    return timestamp_pb2.Timestamp(seconds=seconds, nanos=nanos)


def _rank(engine_id: str, incarnation: str, role: int, tp_rank: int) -> engine.EngineRank:
    return engine.EngineRank(engine_id=engine_id, incarnation=incarnation, role=role, tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1)


def _layout(first_head: int) -> engine.KvLayout:
    regions = [
        engine.KvRegion(
            layer_name=f"model.layers.{layer}.self_attn.attn",
            layer_index=layer,
            group_index=0,
            plane=plane,
            base_address=0x7F3A_0000_0000 + (2 * layer + plane - 1) * 0x1000_0000,
            block_stride_bytes=16 * 4 * 128 * 2,
            head_stride_bytes=16 * 128 * 2,
            token_stride_bytes=128 * 2,
            device_id=1,
        )
        for layer in range(2)
        for plane in (engine.KV_PLANE_KEY, engine.KV_PLANE_VALUE)
    ]
    return engine.KvLayout(
        dtype=engine.KV_DTYPE_BFLOAT16,
        head_size=128,
        total_kv_heads=8,
        first_head=first_head,
        num_local_heads=4,
        num_layers=2,
        memory_kind=engine.MEMORY_KIND_VRAM,
        groups=[engine.KvCacheGroup(group_index=0, kind=engine.KV_CACHE_GROUP_KIND_FULL_ATTENTION, block_size=16, num_blocks=4096)],
        regions=regions,
    )


def _destination() -> transfer.Destination:
    return transfer.Destination(
        engine_id="decode-0",
        incarnation=DECODE_INCARNATION,
        blocks=[engine.BlockList(group_index=0, block_ids=[4095, 17, 18, 300])],
        first_token=16,
        num_tokens=49,
    )


def _source() -> transfer.Source:
    return transfer.Source(
        engine_id="prefill-0",
        incarnation=PREFILL_INCARNATION,
        blocks=[engine.BlockList(group_index=0, block_ids=[0, 1, 2, 3, 1000])],
        num_tokens=65,
    )


def golden_messages() -> dict[str, Message]:
    """Returns the golden messages by file stem."""
    prefill_rank = _rank("prefill-0", PREFILL_INCARNATION, engine.ENGINE_ROLE_PREFILL, 1)
    nixl = engine.NixlAgent(agent_name=f"prefill-0/{PREFILL_INCARNATION}/tp1", agent_metadata=bytes(range(256)) * 3, backends=["UCX", "POSIX"])
    return {
        "register_engine_rank_request": registrar.RegisterEngineRankRequest(
            rank=prefill_rank,
            nixl=nixl,
            layout=_layout(first_head=4),
            compatibility_hash="sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
            lease_ttl=duration_pb2.Duration(seconds=10, nanos=500_000_000),
        ),
        "watch_engines_response": registrar.WatchEnginesResponse(
            type=registrar.ENGINE_EVENT_TYPE_UPSERTED,
            engine=registrar.Engine(
                engine_id="prefill-0",
                incarnation=PREFILL_INCARNATION,
                role=engine.ENGINE_ROLE_PREFILL,
                tp_size=2,
                pp_size=1,
                compatibility_hash="sha256:9f86d081",
                state=registrar.ENGINE_STATE_READY,
                ranks=[registrar.RegisteredRank(rank=prefill_rank, nixl=nixl, layout=_layout(first_head=4), expire_time=_time(1_790_000_010))],
                register_time=_time(1_790_000_000, 123_456_789),
            ),
            reason="",
        ),
        "register_destination_request": rendezvous.RegisterDestinationRequest(
            key=KEY,
            client_request_id=CLIENT_REQUEST_ID,
            prefill_engine_id="prefill-0",
            destination=_destination(),
            timeout=duration_pb2.Duration(seconds=30),
        ),
        "report_prefill_done_request": rendezvous.ReportPrefillDoneRequest(
            key=KEY,
            client_request_id=CLIENT_REQUEST_ID,
            decode_engine_id="decode-0",
            source=_source(),
            timeout=duration_pb2.Duration(seconds=20),
        ),
        "report_write_result_request": rendezvous.ReportWriteResultRequest(
            key=KEY,
            engine_id="prefill-0",
            tp_rank=1,
            pp_rank=0,
            outcome=transfer.WRITE_OUTCOME_WRITTEN,
            bytes_written=2_097_152,
            descriptor_count=3,
            post_time=_time(1_790_000_001, 250_000_000),
            transfer_duration=duration_pb2.Duration(nanos=1_500_000),
            error_message="",
        ),
        "stream_write_orders_response_order": rendezvous.StreamWriteOrdersResponse(
            order=transfer.WriteOrder(
                key=KEY,
                client_request_id=CLIENT_REQUEST_ID,
                source=_source(),
                destination=_destination(),
                decode_tp_ranks=[0, 1],
                write_budget=duration_pb2.Duration(seconds=5),
                trace_context={"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "tracestate": "kvpush=1"},
            ),
            send_time=_time(1_790_000_001, 1_000),
        ),
        "stream_write_orders_response_revocation": rendezvous.StreamWriteOrdersResponse(
            revocation=transfer.Revocation(key=KEY, reason=transfer.END_REASON_SUPERSEDED),
            send_time=_time(1_790_000_002),
        ),
        "transfer_event": transfer.TransferEvent(
            key=KEY,
            client_request_id=CLIENT_REQUEST_ID,
            type=transfer.TRANSFER_EVENT_TYPE_ENDED,
            state=transfer.TRANSFER_STATE_FAILED,
            reason=transfer.END_REASON_REGISTRATION_DEADLINE_EXCEEDED,
            detail="decode deadline passed before prefill-done",
            event_time=_time(1_790_000_031),
        ),
        "transfer": transfer.Transfer(
            key=KEY,
            client_request_id=CLIENT_REQUEST_ID,
            state=transfer.TRANSFER_STATE_DONE,
            prefill_engine_id="prefill-0",
            decode_engine_id="decode-0",
            first_arrival=transfer.TRANSFER_SIDE_DECODE,
            end_reason=transfer.END_REASON_COMPLETED,
            detail="",
            fenced=True,
            deadline=_time(1_790_000_030),
            timeline=[
                transfer.TimelineEntry(kind=kind, time=_time(1_790_000_000, step * 1_000_000), detail=detail)
                for step, (kind, detail) in enumerate(
                    [
                        (transfer.TIMELINE_ENTRY_KIND_REGISTERED, "decode-0"),
                        (transfer.TIMELINE_ENTRY_KIND_PREFILL_DONE, "prefill-0"),
                        (transfer.TIMELINE_ENTRY_KIND_ORDER_SENT, "prefill-0 tp0"),
                        (transfer.TIMELINE_ENTRY_KIND_ORDER_SENT, "prefill-0 tp1"),
                        (transfer.TIMELINE_ENTRY_KIND_WRITE_RESULT, "prefill-0 tp0 WRITTEN"),
                        (transfer.TIMELINE_ENTRY_KIND_WRITE_RESULT, "prefill-0 tp1 WRITTEN"),
                        (transfer.TIMELINE_ENTRY_KIND_ENDED, "COMPLETED"),
                        (transfer.TIMELINE_ENTRY_KIND_FENCED, ""),
                    ]
                )
            ],
            bytes_written=4_194_304,
        ),
    }


def expected_entry(message: Message) -> dict:
    """Returns the expected.json entry of a golden message: its Python class and field values."""
    return {
        "module": type(message).__module__,
        "message": type(message).__name__,
        "fields": json_format.MessageToDict(message, preserving_proto_field_name=True),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--force", action="store_true", help="overwrite existing golden files (only when cutting a new contract version)")
    args = parser.parse_args(argv)
    if EXPECTED_FILE.exists() and not args.force:
        print(f"{EXPECTED_FILE} exists; golden files change only with a new contract version (--force)", file=sys.stderr)
        return 1
    GOLDEN_DIR.mkdir(exist_ok=True)
    expected = {}
    for stem, message in golden_messages().items():
        (GOLDEN_DIR / f"{stem}.binpb").write_bytes(message.SerializeToString(deterministic=True))
        expected[f"{stem}.binpb"] = expected_entry(message)
    EXPECTED_FILE.write_text(json.dumps(expected, indent=2, sort_keys=True) + "\n")
    print(f"wrote {len(expected)} golden messages to {GOLDEN_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
