# SPDX-License-Identifier: Apache-2.0
"""Shared by the sharded-broker tests: transfer ids a given member owns."""

from __future__ import annotations

import itertools
from collections.abc import Collection

from kvpush import shards


def owned(member: str, members: Collection[str], count: int = 1, prefix: str = "t") -> list[str]:
    """The first count transfer ids of prefix0, prefix1, ... that member owns among members (kvpush.shards.owner)."""
    ids = (f"{prefix}{i}" for i in itertools.count())
    return list(itertools.islice((transfer_id for transfer_id in ids if shards.owner(transfer_id, members) == member), count))


def owned_by(member: str, members: Collection[str], prefix: str = "t", skip: int = 0) -> str:
    """The transfer id after the first skip ones that member owns among members."""
    return owned(member, members, skip + 1, prefix)[-1]
