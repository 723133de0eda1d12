# SPDX-License-Identifier: Apache-2.0
"""The etcd-backed registrar's key layout and values: keys read back from both ends, values hold what the mirror needs, lease ids are etcd's in hex."""

from __future__ import annotations

import pytest

from kvpush.dev import sample_engines as sample
from kvpush.services.registrar.etcd_keys import EtcdKeys, decode_rank, encode_rank, lease_name, lease_number

KEYS = EtcdKeys("/kvpush/")


def test_rank_and_departure_keys_read_back_even_with_a_slash_in_the_incarnation():
    key = KEYS.rank("decode-0", "pod/uid-7", (1, 3))
    assert key == b"/kvpush/engines/decode-0/pod/uid-7/1-3"
    assert key.startswith(KEYS.engine("decode-0"))
    assert KEYS.parse_rank(key) == ("decode-0", "pod/uid-7", (1, 3))
    assert KEYS.parse_departure(KEYS.departure("decode-0", "pod/uid-7")) == ("decode-0", "pod/uid-7")
    for other in (b"/kvpush/brokers/m-1", b"/kvpush/engines/decode-0/inc-1/x-1", b"/kvpush/engines/decode-0", KEYS.departure("decode-0", "inc-1")):
        assert KEYS.parse_rank(other) is None
    assert KEYS.parse_departure(key) is None


def test_a_rank_value_holds_the_registration_its_ttl_and_registration_time():
    request = sample.rank_request("decode-0", sample.DECODE, tp_rank=1, tp_size=2)
    engine, ttl_s, register_wall = decode_rank(encode_rank(request, 7, 1_767_225_600.5))
    assert (ttl_s, register_wall) == (7.0, 1_767_225_600.5)
    assert (engine.engine_id, engine.incarnation, engine.role, engine.tp_size, engine.pp_size) == ("decode-0", "inc-1", sample.DECODE, 2, 1)
    assert engine.compatibility_hash == request.compatibility_hash
    registered = engine.ranks[0]
    assert (registered.rank, registered.nixl, registered.layout) == (request.rank, request.nixl, request.layout)


@pytest.mark.parametrize("lease", [1, 0x694D_8B3C_1F2A_0007, 2**63 - 1])
def test_lease_ids_are_etcd_lease_ids_in_hex(lease: int):
    assert lease_number(lease_name(lease)) == lease


@pytest.mark.parametrize("name", ["", "0", "0x10", "-1", "1_0", " 10", "ABC", "8000000000000000", "10000000000000000", "lease-1"])
def test_a_lease_id_that_names_no_etcd_lease(name: str):
    assert lease_number(name) is None
