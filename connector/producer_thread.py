# SPDX-License-Identifier: Apache-2.0
"""A prefill worker's Producer: its ProducerCore (producer.py) run on a transfer thread; other threads only put work in its inbox."""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvpush.connector.handoff import SourceReady
from kvpush.connector.producer import ProducerCore
from kvpush.connector.producer_records import Key
from kvpush.connector.transfer_thread import TransferThread
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb


class Producer:
    """A prefill worker's transfer thread around its ProducerCore; the engine thread only hands work over."""

    def __init__(self, core: ProducerCore, poll_interval_s: float, idle_poll_s: float):
        self.core = core
        self.ready = threading.Event()  # set when a source was released
        core.on_release = self.ready.set
        self._thread = TransferThread(f"kvpush-producer-{core.local.producer}", core, poll_interval_s, idle_poll_s)
        self._streams = 0
        self._member_streams: dict[str, int] = {}  # broker member -> its current stream (control loop only)

    def source_ready(self, ready: SourceReady, ready_event=None, computed_ns: int = 0) -> None:
        """ready_event: a CUDA event recorded after the forward that computed the KV (None on CPU); computed_ns: when
        the engine thread saw that forward end (wall clock; 0: when this thread takes the source)."""
        self._thread.put(("source", ready, ready_event, computed_ns))

    def computing(self, ready: SourceReady, whole: bool = False, announce_at: float | None = None) -> None:
        """This source's forward starts now: layer-progressive push follows its layers; whole: its WRITE is made ahead, posted at the end.

        announce_at: when (time.monotonic) its decode ranks are told the WRITE is due; None: at once.
        """
        self._thread.put(("computing", ready, whole, announce_at))

    def layer_done(self, keys: tuple[Key, ...], layer: int, event=None) -> None:
        """Layer-progressive push: `layer` of these sources is computed (event: recorded after it, on GPU)."""
        self._thread.put(("layer", keys, layer, event))

    def open_stream(self, member: str = "") -> Callable[[rv_pb.StreamWriteOrdersResponse], None]:
        """A new order stream from a broker member: returns the callback for its messages (messages of the member's older streams are ignored)."""
        self._streams += 1
        stream = self._member_streams[member] = self._streams
        self._thread.put(("stream_opened", stream, member))
        return lambda message: self._thread.put(("stream", stream, message))

    def stream_lost(self, member: str = "") -> None:
        stream = self._member_streams.pop(member, None)
        if stream is not None:
            self._thread.put(("stream_lost", stream))

    def on_engine_event(self, event: reg_pb.WatchEnginesResponse) -> None:
        self._thread.put(("engine", event))

    def take_finished(self) -> set[str]:
        """Released sources; the `p.completion` span runs from the WRITE's completion to this hand-back."""
        self.ready.clear()  # before taking: a release racing with us sets it again
        done, written = self.core.take_released()
        now_ns = int(self.core.clock.wall() * 1e9)
        for written_ns, ready in written.values():
            self.core.spans.emit("p.completion", written_ns, now_ns, ready)
        return done

    def has_work(self) -> bool:
        return self.core.holds_sources

    def stop(self) -> None:
        self._thread.stop()

