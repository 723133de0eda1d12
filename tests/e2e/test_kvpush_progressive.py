# SPDX-License-Identifier: Apache-2.0
"""Layer-progressive push inside real vLLM CPU engines (progressive_push "on").

P writes each layer's KV as soon as the layer is computed (save_kv_layer),
the last layer with the source, each part with its notification; D reports
the request received only once every part from every producer rank landed.
Outputs must equal a single engine's (tokens, logprobs within 1e-3, a
control prompt whose logprobs differ), in both arrival orders, with P and D
of different TP and block sizes, and a transfer cancelled while P computes
must end with its reason and free every block.
"""

from __future__ import annotations

import threading

import pytest

from kvpush.dev.localstack.completions import completions, max_logprob_diff, max_logprob_shift
from kvpush.dev.localstack.control_plane import kvpush_transfer_config, start_control_plane
from kvpush.dev.localstack.engines import reference_run, start_vllm_server
from kvpush.dev.localstack.metrics import free_kv_blocks
from kvpush.dev.localstack.prompts import control_prompt, prompt_token_ids
from kvpush.dev.localstack.transfers import cancel_transfer, dispatch, get_transfer, new_transfer_id, transfer_params
from kvpush.rendezvous.v1 import transfer_pb2
from kvpush.telemetry.reader import read_spans
from tests.waiting import wait_for

pytestmark = pytest.mark.engine

PROMPT_LENGTHS = (9, 300, 1000)
MAX_TOKENS = 6
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 4  # layers x planes x KV heads x head size x float32
PROGRESSIVE = {"progressive_push": "on", "hold_margin_s": 1.5, "transfer_timeout_s": 20.0}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model_dir):
    prompts = [prompt_token_ids(n, seed=2000 + n) for n in PROMPT_LENGTHS]
    prompts.append(control_prompt(prompts[2]))
    return prompts, reference_run(model_dir, prompts, MAX_TOKENS, log_path=tmp_path_factory.mktemp("ref") / "reference.log")


def start_pair(work, model_dir, control_plane, traces, prefill_args=(), decode_args=()):
    env = {"KVPUSH_TRACES_FILE": str(traces)}
    servers = []
    for role, engine_id, args, cpu in (("prefill", "prefill-g", prefill_args, "0"), ("decode", "decode-g", decode_args, "1")):
        servers.append(start_vllm_server(model_dir, kv_transfer_config=kvpush_transfer_config(role, engine_id, control_plane, **PROGRESSIVE),
                                         extra_args=list(args), env=env, cpu_list=cpu, log_path=work / f"{role}.log"))
    return servers


def decode_first(control_plane, prefill_url, decode_url, prompt):
    """D's leg, then P's once D registered: (transfer id, D's completion)."""
    transfer_id = new_transfer_id()
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.update(decode=completions(
        decode_url, prompt, MAX_TOKENS, kv_transfer_params=transfer_params("decode", transfer_id, "prefill-g"))))
    thread.start()
    wait_for(lambda: _state({"control_plane": control_plane}, transfer_id) == transfer_pb2.TRANSFER_STATE_WAITING_FOR_PREFILL, 30,
             what="D registered")
    completions(prefill_url, prompt, 1, kv_transfer_params=transfer_params("prefill", transfer_id, "decode-g"))
    thread.join(timeout=120)
    return transfer_id, outcome["decode"]


def parts_received(traces) -> list[int]:
    """Parts D counted per received transfer (the d.wait_for_kv spans)."""
    return [s["attributes"].get("kvpush.parts", 0) for s in read_spans(traces) if s["name"] == "d.wait_for_kv"]


@pytest.mark.parametrize("shape", ["same", "P-tp1-bs128_to_D-tp2-bs64"])
def test_progressive_outputs_equal_a_single_engine(tmp_path, model_dir, reference, shape):
    prompts, expected = reference
    control_plane = start_control_plane(tmp_path / "control-plane", engine_ids=("prefill-g", "decode-g"))
    traces = tmp_path / "traces.jsonl"
    decode_args = ["--tensor-parallel-size", "2", "--block-size", "64"] if shape != "same" else []
    servers = []
    try:
        servers = start_pair(tmp_path, model_dir, control_plane, traces, decode_args=decode_args)
        prefill, decode = servers
        warm = dispatch(prefill.url, "prefill-g", decode.url, "decode-g", prompt_token_ids(20, seed=5), 2)
        assert not isinstance(warm.decode, Exception), warm.decode
        for prompt, want in zip(prompts, expected):
            # D first, so P holds the early order before its forward starts: its layers leave in parts.
            transfer_id, decoded = decode_first(control_plane, prefill.url, decode.url, prompt)
            assert decoded.token_ids == want.token_ids
            assert max_logprob_diff(want, decoded) < 1e-3
            transfer = get_transfer(control_plane, transfer_id)
            assert transfer.state == transfer_pb2.TRANSFER_STATE_DONE
            assert transfer.bytes_written >= (len(prompt) - 1) * KV_BYTES_PER_TOKEN
        assert max_logprob_shift(expected[2], expected[3]) >= 0.05  # the control prompt: equal outputs mean the right KV arrived
        for server in servers:
            server.stop()
        servers = []
        parts = parts_received(traces)  # the warm-up's too, sent both at once
        assert len(parts) >= len(prompts) and sorted(parts)[-len(prompts):] == [2] * len(prompts), parts  # 2 layers, 2 parts
    finally:
        for server in servers:
            server.stop()
        control_plane.stop()


@pytest.fixture(scope="module")
def pair(tmp_path_factory, model_dir):
    work = tmp_path_factory.mktemp("progressive")
    control_plane = start_control_plane(work / "control-plane", engine_ids=("prefill-g", "decode-g"))
    servers = []
    try:
        servers = start_pair(work, model_dir, control_plane, work / "traces.jsonl")
        prefill, decode = servers
        warm = dispatch(prefill.url, "prefill-g", decode.url, "decode-g", prompt_token_ids(20, seed=5), 2)
        assert not isinstance(warm.decode, Exception), warm.decode
        yield {"control_plane": control_plane, "prefill": prefill, "decode": decode,
               "free_blocks": (free_kv_blocks(prefill.url), free_kv_blocks(decode.url))}
    finally:
        for server in servers:
            server.stop()
        control_plane.stop()


@pytest.mark.parametrize("first", ["decode", "prefill"])
def test_progressive_either_arrival_order(pair, reference, first):
    prompts, expected = reference
    transfer_id = new_transfer_id()
    legs = {
        "prefill": (pair["prefill"].url, 1, transfer_params("prefill", transfer_id, "decode-g")),
        "decode": (pair["decode"].url, MAX_TOKENS, transfer_params("decode", transfer_id, "prefill-g")),
    }
    outcome: dict = {}

    def leg(name):
        url, max_tokens, params = legs[name]
        outcome[name] = completions(url, prompts[2], max_tokens, kv_transfer_params=params)

    waiting = {"decode": transfer_pb2.TRANSFER_STATE_WAITING_FOR_PREFILL, "prefill": transfer_pb2.TRANSFER_STATE_WAITING_FOR_REGISTRATION}
    thread = threading.Thread(target=leg, args=(first,))
    thread.start()
    wait_for(lambda: _state(pair, transfer_id) == waiting[first], 30, what=f"{first} side arrived first")
    leg("prefill" if first == "decode" else "decode")
    thread.join(timeout=120)
    assert outcome["decode"].token_ids == expected[2].token_ids
    assert max_logprob_diff(expected[2], outcome["decode"]) < 1e-3
    assert get_transfer(pair["control_plane"], transfer_id).state == transfer_pb2.TRANSFER_STATE_DONE


def test_a_transfer_cancelled_while_p_computes_ends_with_its_reason_and_frees_every_block(pair, reference):
    prompts, expected = reference
    transfer_id = new_transfer_id()
    outcome: dict = {}
    legs = [
        threading.Thread(target=lambda: outcome.update(decode=_leg(pair["decode"].url, prompts[2], MAX_TOKENS,
                                                                    transfer_params("decode", transfer_id, "prefill-g")))),
        threading.Thread(target=lambda: outcome.update(prefill=_leg(pair["prefill"].url, prompts[2], 1,
                                                                     transfer_params("prefill", transfer_id, "decode-g")))),
    ]
    legs[0].start()
    wait_for(lambda: _state(pair, transfer_id) == transfer_pb2.TRANSFER_STATE_WAITING_FOR_PREFILL, 30, what="D registered")
    legs[1].start()
    cancel_transfer(pair["control_plane"], transfer_id)  # as a router does when its client goes: P may be mid-forward
    for thread in legs:
        thread.join(timeout=60)
    transfer = get_transfer(pair["control_plane"], transfer_id)
    if transfer.state == transfer_pb2.TRANSFER_STATE_DONE:
        pytest.skip("the transfer completed before the cancellation reached the broker (nothing to check)")
    assert transfer.state == transfer_pb2.TRANSFER_STATE_CANCELLED and transfer.end_reason == transfer_pb2.END_REASON_CANCELLED_BY_ROUTER
    assert isinstance(outcome["decode"], Exception)  # D never decodes on a partial KV
    prefill_free, decode_free = pair["free_blocks"]

    def blocks_back():
        completions(pair["prefill"].url, prompt_token_ids(4, seed=7), 1)
        completions(pair["decode"].url, prompt_token_ids(4, seed=7), 1)
        return (free_kv_blocks(pair["prefill"].url), free_kv_blocks(pair["decode"].url)) == (prefill_free, decode_free) or None

    wait_for(blocks_back, 30, interval=0.5, what="free blocks back")
    result = dispatch(pair["prefill"].url, "prefill-g", pair["decode"].url, "decode-g", prompts[1], MAX_TOKENS)
    assert result.decode.token_ids == expected[1].token_ids  # the engines keep serving


def _leg(url, prompt, max_tokens, params):
    try:
        return completions(url, prompt, max_tokens, kv_transfer_params=params, timeout=60)
    except Exception as exc:  # the test asserts on which leg failed
        return exc


def _state(pair, transfer_id):
    try:
        return get_transfer(pair["control_plane"], transfer_id).state
    except Exception:  # NOT_FOUND until the first side arrives
        return None
