# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""bench/tcp_proxy.py over real sockets on 127.0.0.1: bytes pass, cut closes both sides and refuses, heal restores the same port."""

from __future__ import annotations

import contextlib
import socket
import threading

import pytest

from bench.tcp_proxy import TcpProxy
from tests.waiting import wait_for

TIMEOUT_S = 5.0


class EchoServer:
    """A TCP server that echoes what it reads and records every connection's end (EOF or reset)."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        self.connections: list[socket.socket] = []
        self.ended = 0  # connections whose client side went away
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self.connections.append(conn)
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    def _echo(self, conn: socket.socket) -> None:
        conn.settimeout(None)
        try:
            while data := conn.recv(65536):
                conn.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            conn.close()  # an echo ends its side when the client ended its own
        with self._lock:
            self.ended += 1

    def close(self) -> None:
        self._stop.set()
        self.listener.close()
        self._thread.join(2)
        for conn in self.connections:
            with contextlib.suppress(OSError):
                conn.close()


@pytest.fixture
def echo():
    server = EchoServer()
    yield server
    server.close()


@pytest.fixture
def proxy(echo):
    with TcpProxy(("127.0.0.1", echo.port)) as running:
        yield running


def connect(proxy: TcpProxy) -> socket.socket:
    return socket.create_connection(("127.0.0.1", proxy.port), timeout=TIMEOUT_S)


def roundtrip(sock: socket.socket, payload: bytes) -> bytes:
    sock.sendall(payload)
    received = b""
    while len(received) < len(payload):
        chunk = sock.recv(65536)
        if not chunk:
            break
        received += chunk
    return received




def closed_by_peer(sock: socket.socket) -> bool:
    """True when the peer ended the connection (EOF or reset), within TIMEOUT_S."""
    sock.settimeout(TIMEOUT_S)
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


def test_bytes_pass_both_ways_unchanged(proxy):
    payload = bytes(range(256)) * 4096  # 1 MiB, every byte value
    with connect(proxy) as sock:
        assert roundtrip(sock, payload) == payload
        assert roundtrip(sock, b"second message") == b"second message"
    total = len(payload) + len(b"second message")
    assert proxy.stats.accepted == 1
    # The counters move just after each forwarded chunk: the last may still be on its way.
    assert wait_for(lambda: proxy.stats.bytes_to_server == proxy.stats.bytes_to_client == total)


def test_several_connections_are_independent(proxy):
    socks = [connect(proxy) for _ in range(5)]
    try:
        for i, sock in enumerate(socks):
            assert roundtrip(sock, f"connection {i}".encode()) == f"connection {i}".encode()
        assert wait_for(lambda: proxy.connections() == 5)
    finally:
        for sock in socks:
            sock.close()
    assert wait_for(lambda: proxy.connections() == 0)


def test_half_close_is_passed_on(proxy, echo):
    with connect(proxy) as sock:
        assert roundtrip(sock, b"ping") == b"ping"
        sock.shutdown(socket.SHUT_WR)  # the echo server reads EOF and closes its side
        assert closed_by_peer(sock)
    assert wait_for(lambda: echo.ended == 1)


def test_cut_closes_both_sides(proxy, echo):
    with connect(proxy) as first, connect(proxy) as second:
        assert roundtrip(first, b"a") == b"a" and roundtrip(second, b"b") == b"b"
        assert proxy.cut() == 2
        assert closed_by_peer(first) and closed_by_peer(second)  # the client side ends
        assert wait_for(lambda: echo.ended == 2)  # and so does the server side
    assert proxy.stats.cut_connections == 2 and proxy.is_cut


def test_refuses_while_cut_then_heals_on_the_same_port(proxy):
    port = proxy.port
    with connect(proxy) as before:
        assert roundtrip(before, b"before") == b"before"
    proxy.cut()
    for _ in range(3):
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S)
    proxy.heal()
    assert proxy.port == port and not proxy.is_cut
    with connect(proxy) as after:
        assert roundtrip(after, b"after the heal") == b"after the heal"
    assert proxy.stats.cut_log[0][1] >= proxy.stats.cut_log[0][0] > 0


def test_cut_and_heal_repeat(proxy):
    for round_ in range(3):
        with connect(proxy) as sock:
            assert roundtrip(sock, b"x%d" % round_) == b"x%d" % round_
            proxy.cut()
            assert closed_by_peer(sock)
        proxy.heal()
    assert proxy.stats.cuts == 3


def test_unreachable_server_resets_the_client():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]  # nothing listens here once the probe closes
    with TcpProxy(("127.0.0.1", dead_port)) as proxy:
        try:
            sock = connect(proxy)
        except ConnectionResetError:
            pass  # the reset overtook the end of connect()
        else:
            with sock:
                assert closed_by_peer(sock)
        assert wait_for(lambda: proxy.stats.upstream_failures == 1)


def test_close_ends_connections_and_listening(echo):
    proxy = TcpProxy(("127.0.0.1", echo.port)).start()
    sock = connect(proxy)
    try:
        assert roundtrip(sock, b"hi") == b"hi"
        proxy.close()
        assert closed_by_peer(sock)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", proxy.port), timeout=TIMEOUT_S)
    finally:
        sock.close()
