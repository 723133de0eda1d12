# SPDX-License-Identifier: Apache-2.0
"""The completion notification a WRITE carries: how a prefill rank tells a decode rank which tokens landed.

Both sides read this one format: the producer builds it (notification), the
consumer parses it (parse_notification). Transfer ids never contain '|'.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpush.connector.handoff import Key

NOTIF_PREFIX = "kvpush1"


def notification(transfer_id: str, attempt: int, producer_rank: int, expected: int, first_token: int, num_tokens: int,
                 part: int = 1, parts: int = 1) -> bytes:
    """The notification of one WRITE: it names the tokens written.

    A layer-progressive transfer is several WRITEs (parts) from one rank;
    each part's notification names its number, and only the last one the
    count (0 before), so D knows when every part from this rank has landed.
    """
    return f"{NOTIF_PREFIX}|{transfer_id}|{attempt}|{producer_rank}|{expected}|{first_token}|{num_tokens}|{part}|{parts}".encode()


@dataclass
class Notification:
    key: Key
    producer: int
    needed: int
    first_token: int
    num_tokens: int
    part: int = 1
    parts: int = 1  # 0 on every part but the last


def parse_notification(message: bytes) -> Notification | None:
    """The notification's fields, or None if it is not a kvpush completion."""
    fields = message.decode(errors="replace").split("|")
    if fields[0] != NOTIF_PREFIX or len(fields) not in (7, 9):  # 7: a producer from before parts (one WRITE per rank)
        return None
    try:
        transfer_id, numbers = fields[1], [int(f) for f in fields[2:]]
    except ValueError:
        return None
    return Notification((transfer_id, numbers[0]), *numbers[1:])
