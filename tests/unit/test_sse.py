# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""kvpush.sse: the one event-stream parser of the router, the local stack, the benchmarks and the tests."""

from __future__ import annotations

import pytest

from kvpush.sse import DONE, MalformedEvent, SseDecoder, sse_payloads, sse_payloads_async


def payloads(body: bytes, **kwargs) -> list:
    return list(sse_payloads(body.splitlines(keepends=True), **kwargs))


def test_events_and_the_done_marker():
    assert payloads(b'data: {"a": 1}\n\ndata: {"a": 2}\n\ndata: [DONE]\n\n') == [{"a": 1}, {"a": 2}, DONE]


def test_consecutive_data_lines_of_one_event_are_joined_with_newlines():
    assert payloads(b'data: {"text":\ndata:  "two lines"}\n\n') == [{"text": "two lines"}]
    # A bare "data" line is an empty data line: "[1,\n\n2]" is one JSON array.
    assert payloads(b"data: [1,\ndata\ndata: 2]\n\n") == [[1, 2]]


def test_an_event_is_dispatched_only_at_its_blank_line():
    decoder = SseDecoder()
    assert decoder.feed(b'data: {"a": 1}\n') == []
    assert decoder.feed(b"\n") == [{"a": 1}]
    assert decoder.feed(b"\n") == []  # a blank line with no data dispatches nothing
    assert payloads(b'data: {"a": 1}\n') == []  # a stream that ends mid-event drops it
    assert SseDecoder().feed_data(b"data: [DONE]\n") == [] and decoder.feed_data(b"data: [DONE]\n") == []
    assert decoder.feed_data(b"\n") == ["[DONE]"]


def test_comments_and_other_fields_are_ignored():
    body = b': keep-alive\n\nevent: message\nid: 7\nretry: 100\ndata: {"a": 1}\n: a comment inside\n\n'
    assert payloads(body) == [{"a": 1}]


def test_crlf_and_cr_line_endings():
    assert payloads(b'data: {"a": 1}\r\n\r\ndata: [DONE]\r\n\r\n') == [{"a": 1}, DONE]
    assert payloads(b'data: {"a": 1}\r\rdata: [DONE]\r\r') == [{"a": 1}, DONE]


def test_no_space_after_the_colon_and_str_lines():
    assert list(sse_payloads(['data:{"a": 1}\n', "\n"])) == [{"a": 1}]


def test_malformed_json_raises_by_default_and_is_skipped_on_request():
    body = b'data: {"a": \n\ndata: {"a": 2}\n\n'
    with pytest.raises(MalformedEvent, match="not JSON"):
        payloads(body)
    assert isinstance(MalformedEvent("x"), ValueError)  # callers that caught json's ValueError still do
    assert payloads(body, skip_malformed=True) == [{"a": 2}]


async def test_async_lines():
    async def lines():
        for line in (b'data: {"a": 1}\n', b"\n", b"data: [DONE]\n", b"\n"):
            yield line

    assert [p async for p in sse_payloads_async(lines())] == [{"a": 1}, DONE]


@pytest.mark.parametrize("body", [
    b'data: {"a": 1}\n\ndata: {"b": "x\\ny"}\n\n: comment\n\ndata: [DONE]\n\n',
    b'data: {"a": 1}\r\n\r\ndata: [1,\r\ndata: 2]\r\n\r\ndata: [DONE]\r\n\r\n',
    b'data: {"a": 1}\r\rdata: [DONE]\r\r',
])
def test_a_stream_cut_anywhere_gives_the_events_its_lines_give(body):
    line_decoder = SseDecoder()
    by_lines = [data for line in body.splitlines(keepends=True) for data in line_decoder.feed_data(line)]
    assert len(by_lines) >= 2 and by_lines[-1] == DONE
    for step in (1, 2, 3, 5, 7, 11, len(body)):
        decoder = SseDecoder()
        pieces = [body[i:i + step] for i in range(0, len(body), step)]
        assert [data for piece in pieces for data in decoder.feed_chunk(piece)] + decoder.feed_chunk(b"") == by_lines, step
    # Every cut in two, between "\r" and "\n" included: that "\r\n" is one line ending, not a line and a blank line.
    for cut in range(len(body) + 1):
        decoder = SseDecoder()
        assert decoder.feed_chunk(body[:cut]) + decoder.feed_chunk(body[cut:]) + decoder.feed_chunk(b"") == by_lines, cut


def test_an_unfinished_event_waits_for_its_blank_line_across_pieces():
    decoder = SseDecoder()
    assert decoder.feed_chunk(b'data: {"a"') == []
    assert decoder.feed_chunk(b': 1}\n') == []
    assert decoder.feed_chunk(b"\r") == []  # a "\r" may be half of "\r\n": held
    assert decoder.feed_chunk(b"\n") == ['{"a": 1}']
