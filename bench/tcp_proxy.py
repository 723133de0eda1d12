# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""A TCP proxy that can cut the network between one client and one server, for fault injection.

    proxy = TcpProxy(("127.0.0.1", control_plane_port))
    proxy.start()              # listens on 127.0.0.1:proxy.port
    ...                        # point the client at proxy.address
    proxy.cut()                # closes every proxied connection (both sides) and refuses new ones
    proxy.heal()               # accepts connections again (on the same port)
    proxy.close()

Bytes pass unchanged in both directions, half-closes included. cut()
shuts both sockets of every connection (the client and the server each
see the connection close) and stops listening: a connect during the cut is
refused (ECONNREFUSED), as with a host that is down. The listening socket
keeps its port across cut() and heal(): on Linux, shutdown() of a listening
socket bound to an explicit port stops it listening and a later listen()
resumes on the same port, so no other process can take the port meanwhile.

Standard library only; one accept thread plus two pump threads per
connection (the proxied clients here hold a handful of gRPC channels).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

BACKLOG = 128
BUFFER_BYTES = 256 * 1024
CONNECT_TIMEOUT_S = 5.0
# How often the accept thread looks up from accept() to notice close().
ACCEPT_POLL_S = 0.2
BIND_ATTEMPTS = 20


@dataclass
class ProxyStats:
    """What went through the proxy so far."""

    accepted: int = 0  # client connections accepted
    upstream_failures: int = 0  # accepted connections whose server could not be reached
    cut_connections: int = 0  # connections closed by cut()
    cuts: int = 0
    bytes_to_server: int = 0
    bytes_to_client: int = 0
    cut_log: list[tuple[float, float]] = field(default_factory=list)  # (cut at, healed at) in time.monotonic(); healed 0 while cut

    def as_dict(self) -> dict:
        return {
            "accepted": self.accepted,
            "upstream_failures": self.upstream_failures,
            "cut_connections": self.cut_connections,
            "cuts": self.cuts,
            "bytes_to_server": self.bytes_to_server,
            "bytes_to_client": self.bytes_to_client,
        }


class _Pair:
    """One proxied connection: the client's socket and the server's."""

    def __init__(self, client: socket.socket, server: socket.socket):
        self.client = client
        self.server = server
        self._lock = threading.Lock()
        self._pumps_left = 2
        self._closed = False

    def shut(self) -> None:
        """Shuts both sockets down (wakes both pumps; each side sees the connection end)."""
        for sock in (self.client, self.server):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def pump_done(self) -> bool:
        """One direction ended; the last one closes both sockets and returns True."""
        with self._lock:
            self._pumps_left -= 1
            last = self._pumps_left == 0
        if last:
            self.close()
        return last

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for sock in (self.client, self.server):
            with contextlib.suppress(OSError):
                sock.close()


class TcpProxy:
    """Forwards TCP connections from listen_host:listen_port to target; cut() and heal() break and restore the path."""

    def __init__(self, target: tuple[str, int], listen_host: str = "127.0.0.1", listen_port: int = 0):
        self.target = target
        self.listen_host = listen_host
        self._requested_port = listen_port
        self.port = 0
        self.stats = ProxyStats()
        self._listener: socket.socket | None = None
        self._pairs: set[_Pair] = set()
        self._lock = threading.Lock()
        self._cut = False
        self._closed = False
        self._healed = threading.Condition(self._lock)
        self._accept_thread: threading.Thread | None = None

    # ---- lifecycle ------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """host:port clients connect to."""
        return f"{self.listen_host}:{self.port}"

    @property
    def is_cut(self) -> bool:
        return self._cut

    def start(self) -> TcpProxy:
        self._listener = self._bind()
        self.port = self._listener.getsockname()[1]
        self._accept_thread = threading.Thread(target=self._accept_loop, name=f"tcp-proxy-{self.port}", daemon=True)
        self._accept_thread.start()
        return self

    def _bind(self) -> socket.socket:
        # An explicit port, never 0: a socket bound to port 0 loses its port
        # when shut down, and cut() relies on keeping it.
        last_error: OSError | None = None
        for _ in range(BIND_ATTEMPTS):
            port = self._requested_port or _free_port(self.listen_host)
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((self.listen_host, port))
                sock.listen(BACKLOG)
            except OSError as exc:
                sock.close()
                last_error = exc
                if self._requested_port:
                    break
                continue
            sock.settimeout(ACCEPT_POLL_S)
            return sock
        raise OSError(f"tcp proxy: cannot listen on {self.listen_host}:{self._requested_port or 'a free port'}: {last_error}")

    def close(self) -> None:
        """Stops accepting and closes every connection (bounded: joins the accept thread for at most 2 s)."""
        with self._lock:
            self._closed = True
            pairs = list(self._pairs)
            self._healed.notify_all()
        for pair in pairs:
            pair.shut()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=2.0)

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- faults ---------------------------------------------------------------------------

    def cut(self) -> int:
        """Closes every proxied connection and refuses new ones until heal(); returns how many connections it cut."""
        with self._lock:
            if self._cut or self._closed:
                return 0
            self._cut = True
            pairs = list(self._pairs)
            self.stats.cuts += 1
            self.stats.cut_connections += len(pairs)
            self.stats.cut_log.append((time.monotonic(), 0.0))
            # Stop listening first, so nothing connects between the cut and the refusals.
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RD)
        for pair in pairs:
            pair.shut()
        return len(pairs)

    def heal(self) -> None:
        """Listens again on the same port; new connections pass as before the cut."""
        with self._lock:
            if not self._cut or self._closed:
                return
            self._listener.listen(BACKLOG)
            self._cut = False
            cut_at, _ = self.stats.cut_log[-1]
            self.stats.cut_log[-1] = (cut_at, time.monotonic())
            self._healed.notify_all()

    def connections(self) -> int:
        """Proxied connections open now."""
        with self._lock:
            return len(self._pairs)

    # ---- threads --------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        listener = self._listener
        while True:
            with self._lock:
                while self._cut and not self._closed:
                    self._healed.wait(ACCEPT_POLL_S)
                if self._closed:
                    return
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                # The listener was shut down by cut() (EINVAL) or closed by close().
                with self._lock:
                    if self._closed:
                        return
                    if not self._cut:
                        self._healed.wait(ACCEPT_POLL_S)
                continue
            self._serve(client)

    def _serve(self, client: socket.socket) -> None:
        client.settimeout(None)
        with self._lock:
            refuse = self._cut or self._closed
            if not refuse:
                self.stats.accepted += 1
        if refuse:  # accepted in the instant before a cut
            _reset(client)
            return
        try:
            server = socket.create_connection(self.target, timeout=CONNECT_TIMEOUT_S)
        except OSError:
            with self._lock:
                self.stats.upstream_failures += 1
            _reset(client)
            return
        server.settimeout(None)
        for sock in (client, server):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pair = _Pair(client, server)
        with self._lock:
            if self._cut or self._closed:
                pair.shut()
                pair.close()
                return
            self._pairs.add(pair)
        threading.Thread(target=self._pump, args=(pair, client, server, "bytes_to_server"), daemon=True, name=f"tcp-proxy-{self.port}-up").start()
        threading.Thread(target=self._pump, args=(pair, server, client, "bytes_to_client"), daemon=True, name=f"tcp-proxy-{self.port}-down").start()

    def _pump(self, pair: _Pair, source: socket.socket, sink: socket.socket, counter: str) -> None:
        try:
            while True:
                data = source.recv(BUFFER_BYTES)
                if not data:
                    # Pass the half-close on: the other direction may still carry bytes.
                    with contextlib.suppress(OSError):
                        sink.shutdown(socket.SHUT_WR)
                    return
                sink.sendall(data)
                with self._lock:
                    setattr(self.stats, counter, getattr(self.stats, counter) + len(data))
        except OSError:
            pair.shut()  # one side broke: the whole connection goes
        finally:
            if pair.pump_done():
                with self._lock:
                    self._pairs.discard(pair)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _reset(sock: socket.socket) -> None:
    """Closes with RST (SO_LINGER 0): the peer sees ECONNRESET, not an orderly end."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()
