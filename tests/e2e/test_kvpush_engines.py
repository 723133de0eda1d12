# SPDX-License-Identifier: Apache-2.0
"""kvpush inside real vLLM CPU engines: one control plane, one P engine, one D engine.

The outputs of every disaggregated request are compared with a single
ordinary engine's (token ids equal, per-token logprobs within 1e-3), the KV
is checked to have moved by NIXL WRITE (broker-reported bytes equal the
prompt's KV size; D never computed the prompt), and failures (abort, missing
prefill, broker down, P killed) must end within their deadlines, free every
block and leave the engines serving.
"""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest

from kvpush.dev.localstack.completions import HttpError, completion_body, completions, max_logprob_diff, max_logprob_shift
from kvpush.dev.localstack.control_plane import kvpush_transfer_config, start_control_plane
from kvpush.dev.localstack.engines import reference_run, start_vllm_server
from kvpush.dev.localstack.metrics import free_kv_blocks
from kvpush.dev.localstack.prompts import control_prompt, prompt_token_ids
from kvpush.dev.localstack.transfers import Dispatch, dispatch, dispatch_in_order, get_transfer, new_transfer_id, transfer_params
from kvpush.rendezvous.v1 import transfer_pb2
from tests.waiting import wait_for

pytestmark = pytest.mark.engine

PROMPT_LENGTHS = (9, 300, 1000)  # below one 128-token block, several blocks, not multiples of the block size
MAX_TOKENS = 8
# Tiny-model geometry: 2 layers x 2 planes x 2 KV heads x 64 channels x 4 bytes per token.
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 4
BLOCK_SIZE = 128  # vLLM CPU's default
ENGINE_EXTRA = {"hold_margin_s": 1.5, "transfer_timeout_s": 20.0}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model_dir):
    work = tmp_path_factory.mktemp("kvpush-stack")
    prompts = [prompt_token_ids(n, seed=n) for n in PROMPT_LENGTHS]
    prompts.append(control_prompt(prompts[1]))
    reference = reference_run(model_dir, prompts, MAX_TOKENS, log_path=work / "reference.log")
    traces = work / "traces.jsonl"
    env = {"KVPUSH_TRACES_FILE": str(traces)}
    control_plane = start_control_plane(work / "control-plane", env=env)
    servers = []
    state = {"control_plane": control_plane}
    try:
        prefill = start_vllm_server(model_dir, kv_transfer_config=kvpush_transfer_config("prefill", "prefill-0", control_plane, **ENGINE_EXTRA),
                                    env=env, cpu_list="0", log_path=work / "prefill.log")
        servers.append(prefill)
        decode = start_vllm_server(model_dir, kv_transfer_config=kvpush_transfer_config("decode", "decode-0", control_plane, **ENGINE_EXTRA),
                                   env=env, cpu_list="1", log_path=work / "decode.log")
        servers.append(decode)
        state.update(work=work, prefill=prefill, decode=decode, prompts=prompts, reference=reference, traces=traces, model_dir=model_dir)
        # Warm-up: an engine's first request pays one-time costs (seconds).
        warm = dispatch(prefill.url, "prefill-0", decode.url, "decode-0", prompt_token_ids(20, seed=99), 2)
        assert not isinstance(warm.decode, Exception), warm.decode
        state["free_blocks"] = (free_kv_blocks(prefill.url), free_kv_blocks(decode.url))
        yield state
    finally:
        for server in servers:
            server.stop()
        state["control_plane"].stop()  # the test that restarts it swaps the handle


def run(stack, prompt, max_tokens=MAX_TOKENS, **kwargs):
    return dispatch(stack["prefill"].url, "prefill-0", stack["decode"].url, "decode-0", prompt, max_tokens, **kwargs)


def assert_matches_reference(result, expected):
    assert not isinstance(result.decode, Exception), result.decode
    assert result.decode.token_ids == expected.token_ids
    assert max_logprob_diff(expected, result.decode) < 1e-3


def assert_blocks_return(stack, timeout=20.0):
    """Free KV blocks on P and D come back to their values before the run."""
    prefill_free, decode_free = stack["free_blocks"]

    def back():
        # vLLM publishes the gauge from engine steps: a short local request makes both step.
        completions(stack["prefill"].url, prompt_token_ids(4, seed=7), 1)
        completions(stack["decode"].url, prompt_token_ids(4, seed=7), 1)
        now = (free_kv_blocks(stack["prefill"].url), free_kv_blocks(stack["decode"].url))
        return now == (prefill_free, decode_free) or None

    wait_for(back, timeout, interval=0.5, what=f"free blocks back to P={prefill_free} D={decode_free}")


def test_outputs_equal_a_single_engine_and_kv_moved_by_write(stack):
    prompts, reference = stack["prompts"], stack["reference"]
    results = [run(stack, p) for p in prompts]
    for result, expected in zip(results, reference):
        assert_matches_reference(result, expected)
    # The control prompt (first half changed) gives clearly different logprobs,
    # so equal outputs above mean the right KV arrived.
    assert max_logprob_shift(reference[1], reference[-1]) >= 0.05
    for result, prompt in zip(results, prompts):
        transfer = get_transfer(stack["control_plane"], result.transfer_id)
        assert transfer.state == transfer_pb2.TRANSFER_STATE_DONE
        # P wrote the KV of every prompt token but the last, which D computes itself
        # (in whole 128-token blocks, as the block sizes match).
        assert transfer.bytes_written == -(-(len(prompt) - 1) // BLOCK_SIZE) * BLOCK_SIZE * KV_BYTES_PER_TOKEN


def test_several_requests_in_flight(stack):
    prompts, reference = stack["prompts"], stack["reference"]
    results: list = [None] * len(prompts)

    def one(i):
        results[i] = run(stack, prompts[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    for result, expected in zip(results, reference):
        assert_matches_reference(result, expected)
    assert_blocks_return(stack)


@pytest.mark.parametrize("first", ["decode", "prefill"])
def test_either_arrival_order(stack, first):
    prompt, expected = stack["prompts"][1], stack["reference"][1]
    control_plane = stack["control_plane"]
    result = dispatch_in_order(control_plane, stack["prefill"].url, "prefill-0", stack["decode"].url, "decode-0", prompt, MAX_TOKENS, first)
    assert_matches_reference(result, expected)
    transfer = get_transfer(control_plane, result.transfer_id)
    assert transfer.state == transfer_pb2.TRANSFER_STATE_DONE
    side = {"decode": transfer_pb2.TRANSFER_SIDE_DECODE, "prefill": transfer_pb2.TRANSFER_SIDE_PREFILL}[first]
    assert transfer.first_arrival == side


def test_abort_while_decode_waits_frees_everything(stack):
    """The client goes away while D waits for KV that never comes: the transfer is cancelled and D's blocks freed."""
    transfer_id = new_transfer_id()
    body = completion_body(stack["prompts"][2], MAX_TOKENS, stream=True, kv_transfer_params=transfer_params("decode", transfer_id, "prefill-0"))
    host, port = stack["decode"].url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    wait_for(lambda: _state(stack, transfer_id) == transfer_pb2.TRANSFER_STATE_WAITING_FOR_PREFILL, 30, what="registration")
    conn.sock.close()  # the client disconnects mid-wait
    conn.close()
    wait_for(lambda: _state(stack, transfer_id) == transfer_pb2.TRANSFER_STATE_CANCELLED, 30, what="transfer cancelled")
    assert get_transfer(stack["control_plane"], transfer_id).end_reason == transfer_pb2.END_REASON_CANCELLED_BY_DECODE
    # D's registration sent P an early order: the attempt is fenced once P answers its revocation, a moment after the cancel.
    wait_for(lambda: get_transfer(stack["control_plane"], transfer_id).fenced, 30, what="attempt fenced")
    assert_blocks_return(stack)


def _decode_leg(stack, prompt, params, outcome: dict, name: str) -> threading.Thread:
    def leg():
        t0 = time.monotonic()
        try:
            outcome[name] = completions(stack["decode"].url, prompt, MAX_TOKENS, kv_transfer_params=params, timeout=120)
        except HttpError as exc:
            outcome[name] = exc
        outcome[name + "_s"] = time.monotonic() - t0

    thread = threading.Thread(target=leg)
    thread.start()
    return thread


def test_a_colliding_decode_key_is_refused_and_the_first_request_still_gets_its_kv(stack):
    """Defect 7: a second decode request with a waiting request's (transfer_id, attempt) took over its receive and leaked a block."""
    transfer_id = new_transfer_id()
    params = transfer_params("decode", transfer_id, "prefill-0", timeout_ms=20_000)
    prompt = stack["prompts"][1]
    outcome: dict = {}
    first = _decode_leg(stack, prompt, params, outcome, "first")
    wait_for(lambda: _state(stack, transfer_id) == transfer_pb2.TRANSFER_STATE_WAITING_FOR_PREFILL, 30, what="registration")
    second = _decode_leg(stack, prompt, params, outcome, "second")
    second.join(timeout=30)
    assert isinstance(outcome.get("second"), HttpError), outcome.get("second")
    assert outcome["second_s"] < 10  # refused at once: nothing naming its blocks left D
    completions(stack["prefill"].url, prompt, 1, kv_transfer_params=transfer_params("prefill", transfer_id, "decode-0", timeout_ms=20_000))
    first.join(timeout=60)
    assert_matches_reference(_as_result(outcome["first"]), stack["reference"][1])
    assert_blocks_return(stack)


def test_a_request_that_never_gets_its_kv_fails_on_an_idle_engine_by_its_deadline_and_hold_margin(stack):
    """Defect 8: a failed request was surfaced only at D's next engine step, so on an idle engine it hung."""
    params = transfer_params("decode", new_transfer_id(), "prefill-0", timeout_ms=3000)
    outcome: dict = {}
    _decode_leg(stack, stack["prompts"][0], params, outcome, "lonely").join(timeout=60)
    assert isinstance(outcome.get("lonely"), HttpError), outcome.get("lonely")
    # Fenced by the broker at its deadline (nothing was ordered), so well before deadline + hold margin.
    assert outcome["lonely_s"] < 3.0 + ENGINE_EXTRA["hold_margin_s"] + 2.0
    assert_blocks_return(stack)


def test_unreadable_kvpush_params_fail_each_request_and_free_its_blocks(stack):
    """Every request with unparseable params used to share one key, so a second one leaked the first's blocks."""
    bad = {"kvpush": {"role": "decode", "transfer_id": "bad id with spaces", "prefill_engine_id": "prefill-0"}}
    outcome: dict = {}
    legs = [_decode_leg(stack, stack["prompts"][i], bad, outcome, f"bad{i}") for i in range(2)]
    for leg in legs:
        leg.join(timeout=60)
    for i in range(2):
        assert isinstance(outcome[f"bad{i}"], HttpError)
        assert outcome[f"bad{i}_s"] < 10
    assert_blocks_return(stack)


def _as_result(decode):
    return Dispatch("", None, decode, 0.0)


def test_missing_prefill_fails_within_deadline_and_engines_keep_serving(stack):
    transfer_id = new_transfer_id()
    params = transfer_params("decode", transfer_id, "prefill-0", timeout_ms=2000)
    t0 = time.monotonic()
    with pytest.raises(HttpError):
        completions(stack["decode"].url, stack["prompts"][1], MAX_TOKENS, kv_transfer_params=params, timeout=60)
    assert time.monotonic() - t0 < 10
    transfer = get_transfer(stack["control_plane"], transfer_id)
    assert transfer.state == transfer_pb2.TRANSFER_STATE_FAILED
    assert transfer.end_reason == transfer_pb2.END_REASON_REGISTRATION_DEADLINE_EXCEEDED
    assert_matches_reference(run(stack, stack["prompts"][1]), stack["reference"][1])
    assert_blocks_return(stack)


def test_broker_down_fails_requests_in_time_then_recovers(stack):
    control_plane = stack["control_plane"]
    control_plane.kill()
    try:
        t0 = time.monotonic()
        result = run(stack, stack["prompts"][1], timeout_ms=2000)
        elapsed = time.monotonic() - t0
        assert isinstance(result.decode, HttpError), result.decode  # D gave up: its deadline plus the safety margin
        assert elapsed < 15
    finally:
        restarted = start_control_plane(control_plane.work_dir, port=control_plane.port, env={"KVPUSH_TRACES_FILE": str(stack["traces"])})
        stack["control_plane"] = restarted
    # Engines re-register with the restarted control plane and serve again.
    def served():
        result = run(stack, stack["prompts"][1], timeout_ms=5000)
        return result if not isinstance(result.decode, Exception) else None

    result = wait_for(served, 60, interval=1.0, what="kvpush serving after the control plane restarted")
    assert_matches_reference(result, stack["reference"][1])
    assert_blocks_return(stack)


def test_prefill_killed_fails_waiting_requests_and_decode_keeps_serving(stack):
    """Last: it kills P. D must fail the waiting request within the registrar's lease time, then keep serving."""
    transfer_id = new_transfer_id()
    params = transfer_params("decode", transfer_id, "prefill-0", timeout_ms=60_000)
    outcome: dict = {}

    def decode_leg():
        t0 = time.monotonic()
        try:
            completions(stack["decode"].url, stack["prompts"][1], MAX_TOKENS, kv_transfer_params=params, timeout=120)
            outcome["error"] = None
        except HttpError as exc:
            outcome["error"] = exc
        outcome["seconds"] = time.monotonic() - t0

    thread = threading.Thread(target=decode_leg)
    thread.start()
    wait_for(lambda: _state(stack, transfer_id) == transfer_pb2.TRANSFER_STATE_WAITING_FOR_PREFILL, 30, what="registration")
    killed_at = time.monotonic()
    stack["prefill"].stop(timeout=0.1)  # SIGTERM then SIGKILL of the whole process group
    thread.join(timeout=60)
    assert isinstance(outcome.get("error"), HttpError)
    assert time.monotonic() - killed_at < 30, "D must not wait for its 60 s deadline"
    transfer = get_transfer(stack["control_plane"], transfer_id)
    assert transfer.end_reason == transfer_pb2.END_REASON_PREFILL_ENGINE_LOST
    # D serves ordinary requests and has every block back.
    decode_free = stack["free_blocks"][1]
    def decode_back():
        completions(stack["decode"].url, prompt_token_ids(4, seed=7), 1)
        return free_kv_blocks(stack["decode"].url) == decode_free
    wait_for(decode_back, 20, interval=0.5, what="decode blocks back")


def _state(stack, transfer_id):
    try:
        return get_transfer(stack["control_plane"], transfer_id).state
    except Exception:
        return None
