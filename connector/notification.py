# SPDX-License-Identifier: Apache-2.0
"""The notifications a prefill rank sends a decode rank: a WRITE's completion (which tokens landed), that a WRITE is due,
and when it was posted.

Both sides read these formats: the producer builds them (notification,
due_notification, posted_notification), the consumer parses them
(parse_notification, parse_due, parse_posted). Transfer ids never contain '|'. A decode rank from before the
due notification logs and ignores it (it is a hint: nothing waits for it).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpush.connector.handoff import Key

NOTIF_PREFIX = "kvpush1"
DUE_TAG = "due"
POSTED_TAG = "posted"


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


def due_notification(transfer_id: str, attempt: int) -> bytes:
    """A WRITE to this attempt's blocks is due: its order is here and its forward ends soon (sent standalone, before the WRITE)."""
    return f"{NOTIF_PREFIX}|{DUE_TAG}|{transfer_id}|{attempt}".encode()


def parse_due(message: bytes) -> Key | None:
    """The attempt a due notification names, or None if the message is not one."""
    fields = message.decode(errors="replace").split("|")
    if len(fields) != 4 or fields[0] != NOTIF_PREFIX or fields[1] != DUE_TAG:
        return None
    try:
        return fields[2], int(fields[3])
    except ValueError:
        return None


def posted_notification(transfer_id: str, attempt: int, producer_rank: int, post_ns: int) -> bytes:
    """This rank's WRITE to the attempt's blocks went out at post_ns (wall clock): D measures the WRITE segment of TTFT
    from it (sent standalone, after the post; a decode rank from before it logs and ignores it)."""
    return f"{NOTIF_PREFIX}|{POSTED_TAG}|{transfer_id}|{attempt}|{producer_rank}|{post_ns}".encode()


def parse_posted(message: bytes) -> tuple[Key, int] | None:
    """(the attempt, its post instant in wall ns) of a posted notification, or None if the message is not one."""
    fields = message.decode(errors="replace").split("|")
    if len(fields) != 6 or fields[0] != NOTIF_PREFIX or fields[1] != POSTED_TAG:
        return None
    try:
        return (fields[2], int(fields[3])), int(fields[5])
    except ValueError:
        return None
