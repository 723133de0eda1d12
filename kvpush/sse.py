# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""Server-sent events as OpenAI-style streams send them: every event's `data:` decoded as JSON, or `DONE`.

One parser (`SseDecoder`) for the router, the local stack's clients, the
benchmarks and the tests. It follows the WHATWG event-stream rules for what
these streams use: consecutive `data:` lines of one event are joined with
"\\n", an event ends at a blank line (one that never ends is dropped),
lines starting with ":" are comments, other fields (`event:`, `id:`,
`retry:`) are ignored, and lines may end in "\\n", "\\r\\n" or "\\r".
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from typing import Any

# The data of the event that ends an OpenAI-style stream.
DONE = "[DONE]"


class MalformedEvent(ValueError):
    """An event whose data is neither JSON nor `DONE`."""


class SseDecoder:
    """Decodes an event stream fed line by line (feed, feed_data) or in pieces cut anywhere (feed_chunk).

    `skip_malformed` drops events whose data is not JSON (what a proxy that
    only peeks at the stream wants); otherwise they raise `MalformedEvent`.
    """

    def __init__(self, *, skip_malformed: bool = False):
        self.skip_malformed = skip_malformed
        self._data: list[str] = []
        self._partial = b""  # feed_chunk: the unfinished line at the end of the last piece

    def feed(self, line: bytes | str) -> list[Any]:
        """The payloads of the events `line` ends: [] until a blank line ends one, then that event's decoded JSON (or `DONE`)."""
        return [payload for data in self.feed_data(line) for payload in self._decode(data)]

    def feed_data(self, line: bytes | str) -> list[str]:
        """The same events undecoded: their joined data, "[DONE]" included (for a reader that needs no JSON)."""
        text = (line.decode("utf-8", errors="replace") if isinstance(line, bytes) else line).rstrip("\r\n")
        if text:
            name, _, value = text.partition(":")
            if name == "data":
                # One space after the colon belongs to the syntax, not the value.
                self._data.append(value[1:] if value.startswith(" ") else value)
            return []
        if not self._data:
            return []
        data, self._data = "\n".join(self._data), []
        return [data]

    def feed_chunk(self, chunk: bytes) -> list[str]:
        """feed_data over a piece of the stream cut anywhere (as a socket read returns it); b"" ends the stream.

        Complete lines are fed; an unfinished one waits for the next piece,
        and so does a final "\r", whose "\n" may come in the next piece.
        """
        lines = (self._partial + chunk).splitlines(keepends=True)
        self._partial = b""
        if chunk and lines and not lines[-1].endswith(b"\n"):  # a final "\r" too
            self._partial = lines.pop()
        return [data for line in lines for data in self.feed_data(line)]

    def _decode(self, data: str) -> list[Any]:
        if data.strip() == DONE:
            return [DONE]
        try:
            return [json.loads(data)]
        except ValueError as exc:
            if self.skip_malformed:
                return []
            raise MalformedEvent(f"an event's data is not JSON: {data[:300]!r}") from exc


def sse_payloads(lines: Iterable[bytes | str], *, skip_malformed: bool = False) -> Iterator[Any]:
    """The payloads of an event stream read as lines (an http.client response, `body.splitlines(keepends=True)`)."""
    decoder = SseDecoder(skip_malformed=skip_malformed)
    for line in lines:
        yield from decoder.feed(line)


async def sse_payloads_async(lines: AsyncIterable[bytes], *, skip_malformed: bool = False) -> AsyncIterator[Any]:
    """The payloads of an event stream read as lines asynchronously (an aiohttp response's `content`)."""
    decoder = SseDecoder(skip_malformed=skip_malformed)
    async for line in lines:
        for payload in decoder.feed(line):
            yield payload
