# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""A serving process's garbage collector: its start frozen, its heap frozen as it goes, a cycle caught at a freeze freed by the
periodic full collection (in a child process, not pytest's)."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import asyncio, gc, json, weakref
from kvpush.services.common import server

class Node:
    pass

async def main():
    before = gc.get_freeze_count()
    server.settle_garbage_collector()
    after_start = gc.get_freeze_count()
    server.FREEZE_EVERY_S, server.FULL_COLLECTION_EVERY_S = 0.02, 1.0
    freezer = asyncio.ensure_future(server.keep_heap_frozen())
    plain, cycle = Node(), Node()
    cycle.me = cycle
    plain_ref, cycle_ref = weakref.ref(plain), weakref.ref(cycle)
    await asyncio.sleep(0.2)
    frozen_with_them = gc.get_freeze_count()
    del plain, cycle
    gc.collect()
    seen = {"plain_freed_at_once": plain_ref() is None, "cycle_kept_while_frozen": cycle_ref() is not None}
    for _ in range(300):  # the full collection is due 1 s after the freezer started
        await asyncio.sleep(0.01)
        if cycle_ref() is None:
            break
    seen["cycle_freed_by_the_full_collection"] = cycle_ref() is None
    freezer.cancel()
    print(json.dumps({"before": before, "after_start": after_start, "frozen_with_them": frozen_with_them, **seen}))

asyncio.run(main())
"""


def test_a_serving_process_keeps_its_heap_frozen_and_still_frees_every_cycle_in_time():
    probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True)
    result = json.loads(probe.stdout.strip().splitlines()[-1])
    assert result["before"] == 0
    assert result["after_start"] > 1000  # the imports (grpc, protobuf, OpenTelemetry) are out of every later walk
    assert result["frozen_with_them"] > result["after_start"]  # the freezer took what was made since
    assert result["plain_freed_at_once"]  # frozen objects still go when their last reference does
    assert result["cycle_kept_while_frozen"]  # a collection does not walk frozen objects...
    assert result["cycle_freed_by_the_full_collection"]  # ...until the periodic full one unfreezes them
