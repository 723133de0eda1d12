# SPDX-License-Identifier: Apache-2.0
"""Carrying out a write plan with memmove, as NIXL's WRITE would, for the layout tests."""

from __future__ import annotations

import ctypes

import numpy as np

from kvpush.connector.write_plans import LocalLayout, PeerRank, WritePlan


def apply(plan: WritePlan, local: LocalLayout, peer_rank: PeerRank) -> int:
    """Does what NIXL's WRITE would with these descriptors (page entries or byte segments); returns the bytes moved."""
    if plan.pages is not None:
        src = local.pages.addresses(plan.pages.local)
        dst = peer_rank.pages.addresses(plan.pages.remote)
        sizes = local.pages.sizes[plan.pages.local.astype(np.int64) // local.pages.num_blocks]
    else:
        src, dst, sizes = plan.plan.src, plan.plan.dst, plan.plan.lengths
    for s, d, n in zip(src, dst, sizes):
        ctypes.memmove(int(d), int(s), int(n))
    return int(np.sum(sizes))
