# SPDX-License-Identifier: Apache-2.0
"""P and D with different tensor-parallel and block sizes, on real vLLM CPU engines.

P with TP 1 writes to both ranks of a TP 2 decode engine (one WRITE per
rank, each with half the KV heads); a TP 2 prefill engine's two ranks both
write to one TP 1 decode rank, which counts two notifications. Block sizes
differ on each side (128 vs 64 tokens), so every token run is re-addressed.
"""

from __future__ import annotations

import pytest

from kvpush.dev.localstack.completions import max_logprob_diff
from kvpush.dev.localstack.control_plane import kvpush_transfer_config, start_control_plane
from kvpush.dev.localstack.engines import reference_run, start_vllm_server
from kvpush.dev.localstack.prompts import prompt_token_ids
from kvpush.dev.localstack.transfers import dispatch, get_transfer
from kvpush.rendezvous.v1 import transfer_pb2

pytestmark = pytest.mark.engine

PROMPT_LENGTHS = (100, 300, 1000)
MAX_TOKENS = 6
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 4  # layers x planes x KV heads x head size x float32


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model_dir):
    prompts = [prompt_token_ids(n, seed=1000 + n) for n in PROMPT_LENGTHS]
    return prompts, reference_run(model_dir, prompts, MAX_TOKENS, log_path=tmp_path_factory.mktemp("ref") / "reference.log")


@pytest.mark.parametrize(
    "prefill_tp,prefill_block,decode_tp,decode_block",
    [(1, 128, 2, 64), (2, 64, 1, 128)],
    ids=["P-tp1-bs128_to_D-tp2-bs64", "P-tp2-bs64_to_D-tp1-bs128"],
)
def test_heterogeneous_tp_and_block_size(tmp_path, model_dir, reference, prefill_tp, prefill_block, decode_tp, decode_block):
    prompts, expected = reference
    control_plane = start_control_plane(tmp_path / "control-plane", engine_ids=("prefill-h", "decode-h"))
    servers = []
    try:
        for role, engine_id, tp, block, cpu in (("prefill", "prefill-h", prefill_tp, prefill_block, "0"),
                                                ("decode", "decode-h", decode_tp, decode_block, "1")):
            servers.append(start_vllm_server(
                model_dir,
                kv_transfer_config=kvpush_transfer_config(role, engine_id, control_plane),
                extra_args=["--tensor-parallel-size", str(tp), "--block-size", str(block)],
                cpu_list=cpu,
                log_path=tmp_path / f"{role}.log",
            ))
        prefill, decode = servers
        warm = dispatch(prefill.url, "prefill-h", decode.url, "decode-h", prompt_token_ids(20, seed=5), 2)
        assert not isinstance(warm.decode, Exception), warm.decode
        for prompt, want in zip(prompts, expected):
            result = dispatch(prefill.url, "prefill-h", decode.url, "decode-h", prompt, MAX_TOKENS)
            assert not isinstance(result.decode, Exception), result.decode
            assert result.decode.token_ids == want.token_ids
            assert max_logprob_diff(want, result.decode) < 1e-3
            transfer = get_transfer(control_plane, result.transfer_id)
            assert transfer.state == transfer_pb2.TRANSFER_STATE_DONE
            assert transfer.bytes_written == (len(prompt) - 1) * KV_BYTES_PER_TOKEN  # D computes the last token itself
            writers = {entry.detail for entry in transfer.timeline if entry.kind == transfer_pb2.TIMELINE_ENTRY_KIND_WRITE_RESULT}
            assert len(writers) == prefill_tp, writers
    finally:
        for server in servers:
            server.stop()
        control_plane.stop()
