# SPDX-License-Identifier: Apache-2.0
"""Following a key prefix in etcd: list it, then apply every change from a watch, resuming and listing again as needed."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import NoReturn

from kvpush.client.backoff import Backoff
from kvpush.errors import KvpushError
from kvpush.etcd.client import Compacted, EtcdClient, WatchBatch

logger = logging.getLogger(__name__)


async def follow_prefix(
    client: EtcdClient,
    prefix: bytes,
    *,
    relist: Callable[[], Awaitable[int]],
    apply: Callable[[WatchBatch], None],
    backoff: Backoff,
    revision: int | None = None,
) -> NoReturn:
    """Applies every change under `prefix` after `revision`, until cancelled.

    `relist()` reads the whole prefix and returns the revision it read at;
    it runs first when `revision` is None (nothing listed yet) and again
    when etcd compacted away the revision a watch would resume from. A
    watch that breaks resumes after the last batch applied, so no change is
    applied twice or skipped. Exceptions other than kvpush's own (a
    listing that finds the caller evicted, say) end the follow.
    """
    while True:
        try:
            if revision is None:
                revision = await relist()
            async with contextlib.aclosing(client.watch_prefix(prefix, start_revision=revision + 1)) as batches:
                async for batch in batches:
                    apply(batch)
                    revision = batch.revision
                    backoff.reset()
        except Compacted as exc:
            logger.warning("etcd compacted the history of %s past revision %d; listing it again", prefix.decode(errors="replace"),
                           exc.compact_revision)
            revision = None
        except KvpushError as exc:
            logger.warning("etcd watch of %s broke (%s); resuming in %.2fs", prefix.decode(errors="replace"), exc, backoff.delay_s)
            await backoff.sleep()
