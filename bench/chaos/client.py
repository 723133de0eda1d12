# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""HTTP requests with a hang watchdog and a deliberate disconnect."""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import socket
import threading
import time
from urllib.parse import urlsplit

from kvpush.sse import DONE, sse_payloads


@dataclasses.dataclass
class Reply:
    """What came back for one HTTP request."""

    status: int = 0  # 0: no HTTP answer
    token_ids: list[int] = dataclasses.field(default_factory=list)
    error: dict | None = None  # the OpenAI-style error object (body or stream event)
    raw: str = ""  # the start of a body that was not understood
    elapsed_s: float = 0.0  # send -> answer complete (or the error)
    first_output_s: float | None = None
    hung: bool = False  # the watchdog ended it: no answer by deadline + HANG_SLACK_S
    disconnected: bool = False  # this client hung up on purpose
    exception: str = ""
    done: bool = False  # a complete answer arrived ([DONE] for streams)


def send(url: str, path: str, body: dict, *, hang_after_s: float, disconnect_after_s: float | None = None,
         headers: dict[str, str] | None = None) -> Reply:
    """POSTs body; a streamed body is read as SSE. Bounded: the connection is shut at hang_after_s."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=hang_after_s + 5.0)
    reply = Reply()
    lock = threading.Lock()
    finished = False

    def interrupt(kind: str) -> None:
        with lock:
            if finished or conn.sock is None:
                return
            setattr(reply, kind, True)
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)

    timers = [threading.Timer(hang_after_s, interrupt, ("hung",))]
    if disconnect_after_s is not None:
        timers.append(threading.Timer(disconnect_after_s, interrupt, ("disconnected",)))
    t0 = time.monotonic()
    for timer in timers:
        timer.daemon = True
        timer.start()
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        reply.status = response.status
        if response.status != 200:
            data = response.read()
            reply.error = _error_of(data)
            if reply.error is None:
                reply.raw = data[:300].decode(errors="replace")
            reply.done = True
        elif body.get("stream"):
            # An event that is not JSON raises MalformedEvent: recorded as the reply's exception.
            for chunk in sse_payloads(response):
                if chunk == DONE:
                    reply.done = True
                    break
                if "error" in chunk:
                    reply.error = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
                    continue
                for choice in chunk.get("choices", []):
                    ids = choice.get("token_ids") or []
                    if ids and reply.first_output_s is None:
                        reply.first_output_s = time.monotonic() - t0
                    reply.token_ids += ids
        else:
            data = response.read()
            out = json.loads(data)
            reply.token_ids = list(out["choices"][0].get("token_ids") or [])
            reply.first_output_s = time.monotonic() - t0
            reply.done = True
    except Exception as exc:  # the caller classifies: hung, disconnected, or a failure without an answer
        reply.exception = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        with lock:
            finished = True
        for timer in timers:
            timer.cancel()
        conn.close()
    reply.elapsed_s = time.monotonic() - t0
    return reply


def _error_of(data: bytes) -> dict | None:
    try:
        parsed = json.loads(data)
    except ValueError:
        return None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        return parsed["error"]
    if isinstance(parsed, dict) and "message" in parsed:  # vLLM's own error shape
        return parsed
    return None
