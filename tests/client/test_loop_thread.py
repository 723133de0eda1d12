# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""LoopThread: synchronous code driving coroutines on a background event loop."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time

import pytest
from fake_control_plane import Behaviour, serve
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from kvpush.client import ClientConfig, LoopThread, RegistrarClient
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb


@pytest.fixture
def loop_thread():
    thread = LoopThread("test-loop")
    yield thread
    thread.stop(timeout_s=2.0)


async def _thread_name() -> str:
    return threading.current_thread().name


async def _fail() -> None:
    raise RuntimeError("boom")


def test_submit_returns_a_future_resolved_on_the_loop_thread(loop_thread):
    assert loop_thread.submit(_thread_name()).result(timeout=2.0) == "test-loop"
    assert loop_thread.call(_thread_name(), timeout_s=2.0) == "test-loop"


def test_fire_and_forget_failures_are_logged(loop_thread, caplog):
    with caplog.at_level(logging.WARNING, logger="kvpush.client.loop_thread"):
        future = loop_thread.submit(_fail())
        with pytest.raises(RuntimeError):
            future.result(timeout=2.0)
        deadline = time.monotonic() + 2.0
        while "boom" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
    assert "background coroutine failed: boom" in caplog.text


def test_call_timeout_cancels_the_coroutine(loop_thread):
    cancelled = threading.Event()

    async def wait_forever():
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(TimeoutError):
        loop_thread.call(wait_forever(), timeout_s=0.1)
    assert cancelled.wait(2.0)


def test_coroutines_run_in_the_callers_otel_context(loop_thread):
    tracer = TracerProvider().get_tracer("test")

    async def current_span_id() -> int:
        return trace.get_current_span().get_span_context().span_id

    with tracer.start_as_current_span("engine-step") as span:
        seen = loop_thread.call(current_span_id(), timeout_s=2.0)
    assert seen == span.get_span_context().span_id


def test_stop_cancels_tasks_and_refuses_new_work():
    thread = LoopThread()
    cleaned_up = threading.Event()

    async def long_running():
        try:
            await asyncio.sleep(60)
        finally:
            cleaned_up.set()

    thread.submit(long_running(), log_errors=False)
    time.sleep(0.05)
    assert thread.stop(timeout_s=2.0)
    assert cleaned_up.is_set()
    with pytest.raises(RuntimeError):
        thread.submit(_thread_name())


def test_stop_is_bounded_when_a_coroutine_blocks_the_loop():
    thread = LoopThread()

    async def block_loop():
        time.sleep(1.0)

    thread.submit(block_loop(), log_errors=False)
    time.sleep(0.05)
    started = time.monotonic()
    assert thread.stop(timeout_s=0.2) is False
    assert time.monotonic() - started < 0.8
    assert thread.stop(timeout_s=3.0)  # the loop stops once the blocking call returns


def test_synchronous_code_drives_a_client_through_loop_threads():
    targets: queue.Queue[str] = queue.Queue()
    stop = asyncio.Event()
    with LoopThread("server-loop") as server_loop, LoopThread("client-loop") as client_loop:
        serving = server_loop.submit(_serve_until(targets, stop), log_errors=False)
        registrar = RegistrarClient(ClientConfig(target=targets.get(timeout=5.0)))
        response = client_loop.call(registrar.get_engine(reg_pb.GetEngineRequest(engine_id="decode-0")), timeout_s=5.0)
        client_loop.call(registrar.close(), timeout_s=2.0)
        server_loop.loop.call_soon_threadsafe(stop.set)
        serving.result(timeout=5.0)
    assert response.engine.engine_id == "decode-0"


async def _serve_until(targets: queue.Queue[str], stop: asyncio.Event) -> None:
    async with serve(Behaviour()) as target:
        targets.put(target)
        await stop.wait()
