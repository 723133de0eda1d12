# SPDX-License-Identifier: Apache-2.0
"""Valid engine-rank registrations and transfer requests for tests and benchmarks.

The NIXL metadata is placeholder bytes: the control plane stores and
forwards it but never opens it.
"""

from __future__ import annotations

from google.protobuf import duration_pb2

from kvpush.engine.v1 import engine_pb2
from kvpush.layout import heads
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb

PREFILL = engine_pb2.ENGINE_ROLE_PREFILL
DECODE = engine_pb2.ENGINE_ROLE_DECODE
COMPATIBILITY_HASH = "sample-model-fp16-v1"


def rank_request(
    engine_id: str,
    role: engine_pb2.EngineRole,
    *,
    incarnation: str = "inc-1",
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    total_kv_heads: int = 2,
    num_layers: int = 2,
    block_size: int = 16,
    num_blocks: int = 1000,
    compatibility_hash: str = COMPATIBILITY_HASH,
    lease_ttl_s: float | None = None,
    mla: bool = False,
) -> reg_pb.RegisterEngineRankRequest:
    """A RegisterEngineRankRequest for one rank holding vLLM's even share of the KV heads (mla: a 576-element latent on every rank).

    A pipeline stage holds its contiguous share of the layers (num_layers is the model's).
    """
    if mla:
        total_kv_heads = 1
    share = heads.even_split(total_kv_heads, tp_size)[tp_rank]
    head_size = 576 if mla else 64
    token_bytes = head_size * 2
    head_stride = block_size * token_bytes
    block_stride = head_stride * share.num_heads
    kind = engine_pb2.KV_CACHE_GROUP_KIND_MLA if mla else engine_pb2.KV_CACHE_GROUP_KIND_FULL_ATTENTION
    layout = engine_pb2.KvLayout(
        dtype=engine_pb2.KV_DTYPE_FLOAT16,
        head_size=head_size,
        total_kv_heads=total_kv_heads,
        first_head=share.first_head,
        num_local_heads=share.num_heads,
        num_layers=num_layers,
        memory_kind=engine_pb2.MEMORY_KIND_DRAM,
        groups=[engine_pb2.KvCacheGroup(group_index=0, kind=kind, block_size=block_size, num_blocks=num_blocks)],
    )
    region_bytes = block_stride * num_blocks
    planes = (engine_pb2.KV_PLANE_LATENT,) if mla else (engine_pb2.KV_PLANE_KEY, engine_pb2.KV_PLANE_VALUE)
    for layer in range(pp_rank * num_layers // pp_size, (pp_rank + 1) * num_layers // pp_size):
        for plane in planes:
            layout.regions.add(
                layer_name=f"model.layers.{layer}.self_attn.attn",
                layer_index=layer,
                group_index=0,
                plane=plane,
                base_address=0x10000000 + (2 * layer + plane) * region_bytes,
                block_stride_bytes=block_stride,
                head_stride_bytes=head_stride,
                token_stride_bytes=token_bytes,
            )
    request = reg_pb.RegisterEngineRankRequest(
        rank=engine_pb2.EngineRank(engine_id=engine_id, incarnation=incarnation, role=role, tp_rank=tp_rank, tp_size=tp_size,
                                 pp_rank=pp_rank, pp_size=pp_size),
        nixl=engine_pb2.NixlAgent(agent_name=f"{engine_id}-{incarnation}-tp{tp_rank}" + (f"-pp{pp_rank}" if pp_size > 1 else ""), agent_metadata=b"nixl-metadata-placeholder", backends=["UCX"]),
        layout=layout,
        compatibility_hash=compatibility_hash,
    )
    if lease_ttl_s is not None:
        request.lease_ttl.FromNanoseconds(int(lease_ttl_s * 1e9))
    return request


def engine_requests(engine_id: str, role: engine_pb2.EngineRole, *, tp_size: int = 1, pp_size: int = 1, **kwargs) -> list[reg_pb.RegisterEngineRankRequest]:
    """One rank_request per (pp rank, tp rank) of an engine."""
    return [rank_request(engine_id, role, tp_rank=r, tp_size=tp_size, pp_rank=s, pp_size=pp_size, **kwargs) for s in range(pp_size) for r in range(tp_size)]


def _timeout(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


def destination_request(
    transfer_id: str,
    attempt: int = 1,
    *,
    decode_engine_id: str = "decode-0",
    prefill_engine_id: str = "prefill-0",
    incarnation: str = "inc-1",
    num_tokens: int = 40,
    first_token: int = 0,
    block_size: int = 16,
    first_block: int = 0,
    timeout_s: float = 30.0,
    client_request_id: str = "",
) -> rv_pb.RegisterDestinationRequest:
    """A RegisterDestinationRequest for num_tokens tokens in consecutive blocks from first_block."""
    count = -(-num_tokens // block_size)
    return rv_pb.RegisterDestinationRequest(
        key=tr_pb.TransferKey(transfer_id=transfer_id, attempt=attempt),
        client_request_id=client_request_id or f"req-{transfer_id}",
        prefill_engine_id=prefill_engine_id,
        destination=tr_pb.Destination(
            engine_id=decode_engine_id,
            incarnation=incarnation,
            blocks=[engine_pb2.BlockList(group_index=0, block_ids=range(first_block, first_block + count))],
            first_token=first_token,
            num_tokens=num_tokens,
        ),
        timeout=_timeout(timeout_s),
    )


def prefill_done_request(
    transfer_id: str,
    attempt: int = 1,
    *,
    prefill_engine_id: str = "prefill-0",
    decode_engine_id: str = "",
    incarnation: str = "inc-1",
    num_tokens: int = 40,
    block_size: int = 16,
    first_block: int = 0,
    timeout_s: float = 30.0,
    client_request_id: str = "",
) -> rv_pb.ReportPrefillDoneRequest:
    """A ReportPrefillDoneRequest for num_tokens tokens in consecutive blocks from first_block."""
    count = -(-num_tokens // block_size)
    return rv_pb.ReportPrefillDoneRequest(
        key=tr_pb.TransferKey(transfer_id=transfer_id, attempt=attempt),
        client_request_id=client_request_id or f"req-{transfer_id}",
        decode_engine_id=decode_engine_id,
        source=tr_pb.Source(
            engine_id=prefill_engine_id,
            incarnation=incarnation,
            blocks=[engine_pb2.BlockList(group_index=0, block_ids=range(first_block, first_block + count))],
            num_tokens=num_tokens,
        ),
        timeout=_timeout(timeout_s),
    )


def write_result_request(
    transfer_id: str,
    attempt: int = 1,
    *,
    engine_id: str = "prefill-0",
    tp_rank: int = 0,
    pp_rank: int = 0,
    outcome: tr_pb.WriteOutcome = tr_pb.WRITE_OUTCOME_WRITTEN,
    bytes_written: int = 4096,
) -> rv_pb.ReportWriteResultRequest:
    return rv_pb.ReportWriteResultRequest(
        key=tr_pb.TransferKey(transfer_id=transfer_id, attempt=attempt),
        engine_id=engine_id,
        tp_rank=tp_rank,
        pp_rank=pp_rank,
        outcome=outcome,
        bytes_written=bytes_written if outcome == tr_pb.WRITE_OUTCOME_WRITTEN else 0,
    )
