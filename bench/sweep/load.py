# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The sweep's client: streamed completions sent at their arrival times, each request's timings, and the warm-up."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

from bench.sweep.grid import Workload
from kvpush.dev.localstack.completions import completion_body
from kvpush.dev.localstack.prompts import prompt_token_ids
from kvpush.sse import DONE, sse_payloads_async

WARMUP_PREFIX = "warmup-"


@dataclasses.dataclass
class RequestRecord:
    """What the client saw of one request (times in s from the run's start unless named _ms)."""

    index: int
    request_id: str
    scheduled_s: float
    sent_s: float = math.nan
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.ttft_ms is not None

    def figures(self) -> dict[str, Any]:
        """The JSON form: no token ids or logprobs (the correctness verdict is stored instead)."""
        return {
            "index": self.index,
            "request_id": self.request_id,
            "scheduled_s": round(self.scheduled_s, 6),
            "send_lag_ms": None if math.isnan(self.sent_s) else round((self.sent_s - self.scheduled_s) * 1000, 3),
            "ttft_ms": self.ttft_ms,
            "tpot_ms": self.tpot_ms,
            "e2e_ms": self.e2e_ms,
            "output_tokens": len(self.token_ids),
            "itl_ms": [round(x, 3) for x in self.itl_ms],
            "error": self.error,
        }


async def stream_one(session: Any, url: str, body: dict[str, Any], record: RequestRecord, started: float, timeout_s: float) -> None:
    """Sends one streamed completion and fills `record` with its timings, tokens and logprobs (never raises)."""
    import aiohttp

    token_times: list[float] = []
    sent = time.monotonic()
    record.sent_s = sent - started
    try:
        async with session.post(url + "/v1/completions", json=body, headers={"X-Request-Id": record.request_id},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            if response.status != 200:
                record.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return
            # An event that is not JSON raises MalformedEvent (a ValueError): the request's error.
            async for chunk in sse_payloads_async(response.content):
                if chunk == DONE:
                    break
                now = time.monotonic()
                if "error" in chunk:
                    record.error = f"stream error: {str(chunk['error'])[:300]}"
                    return
                for choice in chunk.get("choices", []):
                    ids = choice.get("token_ids") or []
                    record.token_ids += ids
                    token_times += [now] * len(ids)
                    record.logprobs += [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300] or type(exc).__name__
    finally:
        if token_times:
            record.ttft_ms = (token_times[0] - sent) * 1000
            record.e2e_ms = (token_times[-1] - sent) * 1000
            record.itl_ms = [(b - a) * 1000 for a, b in zip(token_times, token_times[1:])]
            if len(token_times) > 1:
                record.tpot_ms = (token_times[-1] - token_times[0]) * 1000 / (len(token_times) - 1)
        if not record.error and len(record.token_ids) != body["max_tokens"]:
            record.error = f"{len(record.token_ids)} of {body['max_tokens']} tokens"


async def run_load(url: str, workload: Workload, mode: str, timeout_s: float, on_done) -> tuple[list[RequestRecord], float]:
    """Sends the workload's requests at their arrival offsets; returns the records and the run's wall time (s).

    Every request is bounded by `timeout_s`, and the whole run by the last
    arrival plus `timeout_s` plus a margin, so a stuck engine cannot stall it.
    """
    import aiohttp

    point = workload.point
    records = [RequestRecord(i, point.request_id(mode, i), offset) for i, offset in enumerate(workload.offsets_s)]
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, read_bufsize=4 * 1024 * 1024) as session:
        started = time.monotonic()

        async def one(record: RequestRecord, prompt: list[int]) -> None:
            await asyncio.sleep(max(0.0, started + record.scheduled_s - time.monotonic()))
            body = completion_body(prompt, point.output_len, stream=True)
            await stream_one(session, url, body, record, started, timeout_s)
            on_done()

        tasks = [asyncio.create_task(one(r, p)) for r, p in zip(records, workload.prompts)]
        limit = workload.offsets_s[-1] + timeout_s + 30.0
        done, pending = await asyncio.wait(tasks, timeout=limit)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for record in records:
            if record.ttft_ms is None and not record.error:
                record.error = f"not finished within the run's limit of {limit:.0f} s"
        wall = time.monotonic() - started
    return records, wall


async def warm_up(url: str, input_lens: Sequence[int], timeout_s: float) -> list[str]:
    """A few sequential requests per input length, then a concurrent burst: the first requests pay one-time costs."""
    import aiohttp

    errors = []
    async with aiohttp.ClientSession() as session:
        index = 0
        for input_len in input_lens:
            for _ in range(2):
                record = RequestRecord(index, f"{WARMUP_PREFIX}{index}", 0.0)
                body = completion_body(prompt_token_ids(input_len, seed=900_000 + index), 8, stream=True)
                await stream_one(session, url, body, record, time.monotonic(), timeout_s)
                errors += [record.error] if record.error else []
                index += 1
        burst = []
        for input_len in input_lens:
            for _ in range(2):
                record = RequestRecord(index, f"{WARMUP_PREFIX}{index}", 0.0)
                body = completion_body(prompt_token_ids(input_len, seed=900_000 + index), 8, stream=True)
                burst.append((record, body))
                index += 1
        await asyncio.gather(*(stream_one(session, url, body, record, time.monotonic(), timeout_s) for record, body in burst))
        errors += [record.error for record, _ in burst if record.error]
    return errors
