# SPDX-License-Identifier: Apache-2.0
"""RegistrarCore: every invalid registration is refused with its exact reason and field."""

from __future__ import annotations

import pytest
from registrar_harness import expect

from kvpush import errors
from kvpush.dev import sample_engines as sample
from kvpush.errors import Reason
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.services.registrar.core import RegistrarCore

# ----- validation -----


def _set(path: str, value):
    def mutate(request: reg_pb.RegisterEngineRankRequest) -> None:
        *parents, leaf = path.split(".")
        target = request
        for part in parents:
            if part.endswith("]"):
                name, index = part[:-1].split("[")
                target = getattr(target, name)[int(index)]
            else:
                target = getattr(target, part)
        setattr(target, leaf, value)

    return mutate


def _clear(field: str):
    return lambda request: request.ClearField(field)


def _duplicate_region(request: reg_pb.RegisterEngineRankRequest) -> None:
    request.layout.regions[1].plane = request.layout.regions[0].plane


def _negative_ttl(request: reg_pb.RegisterEngineRankRequest) -> None:
    request.lease_ttl.seconds = -1


def _clear_groups(request: reg_pb.RegisterEngineRankRequest) -> None:
    del request.layout.groups[:]


def _clear_regions(request: reg_pb.RegisterEngineRankRequest) -> None:
    del request.layout.regions[:]


def _huge_metadata(request: reg_pb.RegisterEngineRankRequest) -> None:
    request.nixl.agent_metadata = b"x" * (4 * 1024 * 1024 + 1)


def _empty_backend(request: reg_pb.RegisterEngineRankRequest) -> None:
    request.nixl.backends.append("")


INVALID_REGISTRATIONS = [
    ("no rank", _clear("rank"), Reason.FIELD_REQUIRED, "rank"),
    ("empty engine id", _set("rank.engine_id", ""), Reason.FIELD_REQUIRED, "rank.engine_id"),
    ("engine id with a space", _set("rank.engine_id", "prefill 0"), Reason.FIELD_INVALID, "rank.engine_id"),
    ("engine id of 129 characters", _set("rank.engine_id", "p" * 129), Reason.FIELD_INVALID, "rank.engine_id"),
    ("empty incarnation", _set("rank.incarnation", ""), Reason.FIELD_REQUIRED, "rank.incarnation"),
    ("unspecified role", _set("rank.role", 0), Reason.FIELD_REQUIRED, "rank.role"),
    ("unknown role", _set("rank.role", 9), Reason.FIELD_INVALID, "rank.role"),
    ("zero tp_size", _set("rank.tp_size", 0), Reason.FIELD_REQUIRED, "rank.tp_size"),
    ("zero pp_size", _set("rank.pp_size", 0), Reason.FIELD_REQUIRED, "rank.pp_size"),
    ("tp_rank not below tp_size", _set("rank.tp_rank", 1), Reason.FIELD_OUT_OF_RANGE, "rank.tp_rank"),
    ("pp_rank not below pp_size", _set("rank.pp_rank", 1), Reason.FIELD_OUT_OF_RANGE, "rank.pp_rank"),
    ("too many ranks", _set("rank.tp_size", 2048), Reason.FIELD_OUT_OF_RANGE, "rank.tp_size"),
    ("no nixl", _clear("nixl"), Reason.FIELD_REQUIRED, "nixl"),
    ("empty agent name", _set("nixl.agent_name", ""), Reason.FIELD_REQUIRED, "nixl.agent_name"),
    ("empty agent metadata", _set("nixl.agent_metadata", b""), Reason.FIELD_REQUIRED, "nixl.agent_metadata"),
    ("agent metadata too large", _huge_metadata, Reason.FIELD_OUT_OF_RANGE, "nixl.agent_metadata"),
    ("empty backend name", _empty_backend, Reason.FIELD_REQUIRED, "nixl.backends[1]"),
    ("no layout", _clear("layout"), Reason.FIELD_REQUIRED, "layout"),
    ("unspecified dtype", _set("layout.dtype", 0), Reason.FIELD_REQUIRED, "layout.dtype"),
    ("zero head size", _set("layout.head_size", 0), Reason.FIELD_REQUIRED, "layout.head_size"),
    ("heads beyond total", _set("layout.first_head", 1), Reason.FIELD_OUT_OF_RANGE, "layout.first_head"),
    ("zero layers", _set("layout.num_layers", 0), Reason.FIELD_REQUIRED, "layout.num_layers"),
    ("unspecified memory kind", _set("layout.memory_kind", 0), Reason.FIELD_REQUIRED, "layout.memory_kind"),
    ("no groups", _clear_groups, Reason.FIELD_REQUIRED, "layout.groups"),
    ("unspecified group kind", _set("layout.groups[0].kind", 0), Reason.FIELD_REQUIRED, "layout.groups[0].kind"),
    ("zero block size", _set("layout.groups[0].block_size", 0), Reason.FIELD_REQUIRED, "layout.groups[0].block_size"),
    ("zero blocks", _set("layout.groups[0].num_blocks", 0), Reason.FIELD_REQUIRED, "layout.groups[0].num_blocks"),
    ("kernel block not dividing the block", _set("layout.groups[0].kernel_block_size", 24), Reason.FIELD_OUT_OF_RANGE,
     "layout.groups[0].kernel_block_size"),
    ("state tensors on an attention group", lambda r: r.layout.groups[0].state_tensors.add(element_bytes=4, shape=[4], segments=[{}]),
     Reason.FIELD_INVALID, "layout.groups[0].state_tensors[0]"),
    ("no regions", _clear_regions, Reason.FIELD_REQUIRED, "layout.regions"),
    ("region without base address", _set("layout.regions[3].base_address", 0), Reason.FIELD_REQUIRED, "layout.regions[3].base_address"),
    ("region in unknown group", _set("layout.regions[1].group_index", 5), Reason.FIELD_INVALID, "layout.regions[1].group_index"),
    ("region beyond the layers", _set("layout.regions[2].layer_index", 2), Reason.FIELD_OUT_OF_RANGE, "layout.regions[2].layer_index"),
    ("region without a plane", _set("layout.regions[0].plane", 0), Reason.FIELD_REQUIRED, "layout.regions[0].plane"),
    ("region described twice", _duplicate_region, Reason.FIELD_INVALID, "layout.regions[1].plane"),
    ("region without block stride", _set("layout.regions[0].block_stride_bytes", 0), Reason.FIELD_REQUIRED, "layout.regions[0].block_stride_bytes"),
    ("region without token stride", _set("layout.regions[0].token_stride_bytes", 0), Reason.FIELD_REQUIRED, "layout.regions[0].token_stride_bytes"),
    ("region without head stride", _set("layout.regions[0].head_stride_bytes", 0), Reason.FIELD_REQUIRED, "layout.regions[0].head_stride_bytes"),
    ("empty compatibility hash", _set("compatibility_hash", ""), Reason.FIELD_REQUIRED, "compatibility_hash"),
    ("negative lease ttl", _negative_ttl, Reason.FIELD_OUT_OF_RANGE, "lease_ttl"),
]


@pytest.mark.parametrize("mutate, reason, field", [case[1:] for case in INVALID_REGISTRATIONS], ids=[case[0] for case in INVALID_REGISTRATIONS])
def test_every_invalid_field_is_refused_with_its_reason_and_path(registrar: RegistrarCore, mutate, reason: str, field: str):
    request = sample.rank_request("prefill-0", sample.PREFILL, total_kv_heads=2)
    mutate(request)
    expect(errors.InvalidArgument, reason, field, registrar.register, request)
    assert registrar.get_engine("prefill-0") is None


def test_a_region_with_one_local_head_needs_no_head_stride(registrar: RegistrarCore):
    request = sample.rank_request("decode-0", sample.DECODE, tp_size=2, total_kv_heads=2)
    request.layout.regions[0].head_stride_bytes = 0
    registrar.register(request)
    assert registrar.get_engine("decode-0") is not None
