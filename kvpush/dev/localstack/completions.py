# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""Greedy `/v1/completions` against an engine or a router, streamed or not, and the comparison of their outputs.

Synchronous, standard library only (http.client), so tests and benchmark
threads can call it anywhere.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvpush.sse import DONE, sse_payloads

SERVED_MODEL_NAME = "tiny"
HEALTH_TIMEOUT_S = 2.0


class HttpError(RuntimeError):
    """A non-200 answer from a server."""

    def __init__(self, status: int, body: bytes):
        super().__init__(f"HTTP {status}: {body[:2000].decode(errors='replace')}")
        self.status = status
        self.body = body


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urlsplit(url)
    if parts.hostname is None:
        raise ValueError(f"no host in {url!r}")
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout), parts.path


def request(method: str, url: str, body: dict | None = None, headers: Mapping[str, str] | None = None,
            timeout: float = 120.0) -> tuple[int, bytes]:
    """One HTTP request with a JSON body; returns the status and the whole answer."""
    conn, path = _connection(url, timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path or "/", body=data, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def healthy(url: str) -> bool:
    """Whether `GET /health` answers 200 now."""
    try:
        status, _ = request("GET", url + "/health", timeout=HEALTH_TIMEOUT_S)
    except OSError:
        return False
    return status == 200


@dataclass
class Completion:
    """One completion's generated tokens.

    `logprobs[i]` is the logprob of `token_ids[i]` under greedy sampling;
    `kv_transfer_params` is what the engine returned (P legs in pull mode).
    For streamed calls `ttft_s` is request send → first token chunk, and
    `token_times_s` the arrival time of each token after the send.
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str = ""
    kv_transfer_params: dict | None = None
    finish_reason: str | None = None
    ttft_s: float | None = None
    total_s: float = 0.0
    token_times_s: list[float] = field(default_factory=list)


def completion_body(prompt: str | Sequence[int], max_tokens: int, *, logprobs: int = 1,
                    kv_transfer_params: Mapping | None = None, ignore_eos: bool = True, stream: bool = False,
                    model: str = SERVED_MODEL_NAME) -> dict:
    """The `/v1/completions` body used throughout: greedy, with token ids and logprobs.

    `return_token_ids` gives the ids directly (vLLM 0.32), so no
    detokenization round trip is needed to compare outputs.
    """
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt if isinstance(prompt, str) else list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": logprobs,
        "return_token_ids": True,
        "ignore_eos": ignore_eos,
        "stream": stream,
    }
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = dict(kv_transfer_params)
    return body


def completions(url: str, prompt: str | Sequence[int], max_tokens: int, logprobs: int = 1,
                kv_transfer_params: Mapping | None = None, headers: Mapping[str, str] | None = None, *,
                ignore_eos: bool = True, timeout: float = 120.0) -> Completion:
    """A non-streaming greedy completion; returns ids, per-token logprobs and `kv_transfer_params`."""
    body = completion_body(prompt, max_tokens, logprobs=logprobs, kv_transfer_params=kv_transfer_params,
                           ignore_eos=ignore_eos)
    t0 = time.monotonic()
    status, data = request("POST", url + "/v1/completions", body, headers, timeout)
    if status != 200:
        raise HttpError(status, data)
    out = json.loads(data)
    choice = out["choices"][0]
    return Completion(token_ids=list(choice.get("token_ids") or []),
                      logprobs=[float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []],
                      text=choice.get("text", ""), kv_transfer_params=out.get("kv_transfer_params"),
                      finish_reason=choice.get("finish_reason"), total_s=time.monotonic() - t0)


def stream_completions(url: str, prompt: str | Sequence[int], max_tokens: int, logprobs: int = 1,
                       kv_transfer_params: Mapping | None = None, headers: Mapping[str, str] | None = None, *,
                       ignore_eos: bool = True, timeout: float = 120.0, t0: float | None = None) -> Completion:
    """A streamed greedy completion with client-side timing; an event that is not JSON raises `kvpush.sse.MalformedEvent`.

    `t0` (a `time.monotonic()` value) is the instant TTFT is measured from;
    by default the moment this call starts (routers pass their own send time).
    """
    t0 = time.monotonic() if t0 is None else t0
    body = completion_body(prompt, max_tokens, logprobs=logprobs, kv_transfer_params=kv_transfer_params,
                           ignore_eos=ignore_eos, stream=True)
    conn, path = _connection(url, timeout)
    result = Completion(token_ids=[], logprobs=[])
    try:
        conn.request("POST", path + "/v1/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        if resp.status != 200:
            raise HttpError(resp.status, resp.read())
        for chunk in sse_payloads(resp):
            if chunk == DONE:
                break
            now = time.monotonic() - t0
            for choice in chunk.get("choices", []):
                ids = choice.get("token_ids") or []
                if ids and result.ttft_s is None:
                    result.ttft_s = now
                result.token_ids += ids
                result.token_times_s += [now] * len(ids)
                result.logprobs += [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
                result.text += choice.get("text", "")
                result.finish_reason = choice.get("finish_reason") or result.finish_reason
            if chunk.get("kv_transfer_params"):
                result.kv_transfer_params = chunk["kv_transfer_params"]
    finally:
        conn.close()
    result.total_s = time.monotonic() - t0
    return result


def max_logprob_diff(expected: Completion, actual: Completion) -> float:
    """Largest per-token |logprob| difference (inf when the token ids differ)."""
    if expected.token_ids != actual.token_ids or len(expected.logprobs) != len(actual.logprobs):
        return float("inf")
    return max((abs(a - b) for a, b in zip(expected.logprobs, actual.logprobs)), default=0.0)


def max_logprob_shift(a: Completion, b: Completion) -> float:
    """Largest per-position |logprob| difference of two outputs, whatever their tokens."""
    return max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs))
