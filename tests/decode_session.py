# SPDX-License-Identifier: Apache-2.0
"""Shared by the connector tests against sharded brokers: a decode engine's control session feeding its DecodeWaits."""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Iterator

from kvpush.clock import ManualClock
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.control import ControlSession
from kvpush.connector.decode_waits import DecodeWaits
from kvpush.connector.params import TransferParams
from kvpush.connector.report_stream import Report
from kvpush.dev import sample_engines as sample
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb


class DecodeSession:
    """decode-0's session on a broker (member) at control_plane: registrations go out on its report stream, every member's
    StreamTransferEvents and members leaving reach waits (on a ManualClock) when drain() is called; answers[transfer_id] is (answer, error)."""

    def __init__(self, control_plane: str, token: str, name: str):
        config = ConnectorConfig(engine_id="decode-0", role="decode", control_plane=control_plane, token=token, rpc_timeout_s=2.0)
        self.session = ControlSession(config, name)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.session.on_member_left(lambda member, members: self.inbox.put(("member_left", member, members)))
        self.clock = ManualClock()
        self.waits = DecodeWaits(self.clock, hold_margin_s=2.0)
        self.answers: dict[str, tuple] = {}
        self.reports = None

    def start(self) -> None:
        self.reports = self.session.report_stream("decode-0")
        events = rv_pb.StreamTransferEventsRequest(engine_id="decode-0", incarnation="inc-1")
        self.session.follow_members("StreamTransferEvents", lambda broker: broker.stream_transfer_events(events),
                                    lambda member: lambda message: self.inbox.put(("on_event", message.event)))

    def register(self, transfer_id: str) -> None:
        """Admits the request d-<transfer_id> waiting for prefill-0 and sends its registration (attempt 1)."""
        key = (transfer_id, 1)
        self.waits.admit(f"d-{transfer_id}", TransferParams("decode", transfer_id, 1, "prefill-0", None, "", ""), "", 10.0, 0)
        self.waits.registered(f"d-{transfer_id}")
        self.reports.send(Report("registrations", sample.destination_request(transfer_id),
                                 lambda answer, error: self.answers.__setitem__(transfer_id, (answer, error)),
                                 on_route=lambda member: self.inbox.put(("routed", key, member))))

    def drain(self) -> None:
        """Hands what the session heard so far to waits."""
        while not self.inbox.empty():
            kind, *args = self.inbox.get()
            getattr(self.waits, kind)(*args)


@contextlib.contextmanager
def decode_session(control_plane: str, token: str, name: str) -> Iterator[DecodeSession]:
    """A started DecodeSession, closed on the way out."""
    decode = DecodeSession(control_plane, token, name)
    try:
        decode.start()
        yield decode
    finally:
        decode.session.close()
