# SPDX-License-Identifier: Apache-2.0
"""MLA (DeepSeek-V2-style latent KV) between real vLLM CPU engines, with any TP sizes.

The latent is the same on every TP rank: each decode rank receives the
whole latent, from one prefill rank (rank d mod P's TP), and counts one
notification. vLLM's CPU platform runs MLA with 16-token blocks and prefix
caching off.

The reference is vLLM's own pull connector between engines of the same
TP sizes, not a single engine: vLLM-CPU's MLA decode step is not
numerically its prefill (bench/parity.py shows it in one plain engine) and
its numerics change with the TP sizes, and a P/D decode engine computes the
prompt's last token with that decode step over the KV it received,
whichever connector delivered it. kvpush and upstream pull then agree to
the last bit (docs/parity.md).
"""

from __future__ import annotations

import pytest

from bench.upstream import pull_route, upstream_spec
from kvpush.dev.localstack.completions import HttpError, completions, max_logprob_shift
from kvpush.dev.localstack.control_plane import kvpush_transfer_config, start_control_plane
from kvpush.dev.localstack.engines import start_vllm_servers
from kvpush.dev.localstack.metrics import free_kv_blocks
from kvpush.dev.localstack.prompts import control_prompt, prompt_token_ids
from kvpush.dev.localstack.stack import Stack
from kvpush.dev.localstack.transfers import dispatch, get_transfer
from kvpush.dev.tinymodel import build_tiny_model, default_model_dir
from kvpush.rendezvous.v1 import transfer_pb2
from kvpush.telemetry.reader import read_spans
from tests.e2e.pd_pair import MAX_TOKENS, checked_transfers
from tests.waiting import wait_for

pytestmark = pytest.mark.engine

PROMPT_LENGTHS = (9, 300, 1000)  # within one 16-token block, many blocks, not multiples of the block size
BLOCK_SIZE = 16  # forced by vLLM-CPU for MLA
LATENT_BYTES_PER_TOKEN = 2 * 576 * 4  # layers x (kv_lora_rank 512 + rope 64) x float32: one plane, no K/V split


@pytest.fixture(scope="module")
def mla_model():
    return build_tiny_model(default_model_dir("deepseek_v2"), arch="deepseek_v2")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, mla_model):
    """Upstream pull's outputs (NixlConnector) on the prompts, for P's and D's TP sizes.

    The TP sizes change vLLM-CPU's MLA numerics (P's latent, D's decode
    step) enough to flip this sensitive tiny model's tokens, so each pair of
    sizes has its own reference.
    """
    prompts = [prompt_token_ids(n, seed=n) for n in PROMPT_LENGTHS]
    prompts.append(control_prompt(prompts[1]))
    by_sizes: dict[tuple[int, int], list] = {}

    def outputs(p_tp: int, d_tp: int) -> tuple[list, list]:
        if (p_tp, d_tp) not in by_sizes:
            sizes = {"prefill": ["--tensor-parallel-size", str(p_tp)], "decode": ["--tensor-parallel-size", str(d_tp)]}
            spec = upstream_spec("pull", prefill_cpus="0", decode_cpus="1", engine_args_by_role=sizes)
            with Stack(spec, mla_model, tmp_path_factory.mktemp(f"mla-pull-p{p_tp}-d{d_tp}")) as stack:
                stack.start()
                by_sizes[p_tp, d_tp] = [pull_route(stack, prompt, MAX_TOKENS).decode for prompt in prompts]
            # The control prompt (first half changed) moves the logprobs clearly, so equal outputs mean the right KV arrived.
            assert max_logprob_shift(by_sizes[p_tp, d_tp][1], by_sizes[p_tp, d_tp][-1]) >= 0.05
        return prompts[:-1], by_sizes[p_tp, d_tp][:-1]

    return outputs


@pytest.mark.parametrize("p_tp, d_tp, progressive", [(1, 1, "off"), (1, 1, "on"), (1, 2, "off"), (2, 1, "off")],
                         ids=["P-tp1_to_D-tp1", "P-tp1_to_D-tp1-layer-progressive", "P-tp1_to_D-tp2", "P-tp2_to_D-tp1"])
def test_the_latent_reaches_every_decode_rank_from_one_prefill_rank(tmp_path, mla_model, reference, p_tp, d_tp, progressive):
    prompts, expected = reference(p_tp, d_tp)
    control_plane = start_control_plane(tmp_path / "control-plane", engine_ids=("prefill-m", "decode-m"))
    servers = []
    try:
        # Layer-progressive push ("on"): P writes each MLA layer's latent as soon as the layer is computed.
        config = {role: kvpush_transfer_config(role, f"{role}-m", control_plane, progressive_push=progressive) for role in ("prefill", "decode")}
        traces = tmp_path / "traces.jsonl"
        servers = start_vllm_servers([dict(name=role, kv_transfer_config=config[role], env={"KVPUSH_TRACES_FILE": str(traces)},
                                           extra_args=["--tensor-parallel-size", str(tp)], cpu_list=cpu, log_path=tmp_path / f"{role}.log")
                                      for role, tp, cpu in (("prefill", p_tp, "0"), ("decode", d_tp, "1"))], mla_model)
        prefill, decode = servers
        for prompt, transfer in checked_transfers(control_plane, prefill, decode, ("prefill-m", "decode-m"), prompts, expected, both_orders_at=1):
            # Every D rank got the latent of every prompt token but the last, in whole 16-token pages.
            pages = -(-(len(prompt) - 1) // BLOCK_SIZE)
            assert transfer.bytes_written == d_tp * pages * BLOCK_SIZE * LATENT_BYTES_PER_TOKEN
            # One P rank writes each D rank, so as many ranks write as the smaller TP size.
            writers = {e.detail for e in transfer.timeline if e.kind == transfer_pb2.TIMELINE_ENTRY_KIND_WRITE_RESULT}
            assert len(writers) == min(p_tp, d_tp), writers
        for server in servers:
            server.stop()  # their spans are exported by then
        servers = []
        # D counted its parts per transfer: progressive, the decode-first transfer's two layers left in two parts.
        parts = [s["attributes"].get("kvpush.parts", 0) for s in read_spans(traces) if s["name"] == "d.wait_for_kv"]
        assert max(parts) == (2 if progressive == "on" else 1), parts
    finally:
        for server in servers:
            server.stop()
        control_plane.stop()


def test_an_mla_prefill_and_a_dense_decode_engine_are_refused_naming_both_and_give_back_every_block(tmp_path, mla_model, model_dir):
    control_plane = start_control_plane(tmp_path / "control-plane", engine_ids=("prefill-m", "decode-d"))
    servers = []
    try:
        for role, engine_id, model, cpu in (("prefill", "prefill-m", mla_model, "0"), ("decode", "decode-d", model_dir, "1")):
            servers += start_vllm_servers([dict(name=role, kv_transfer_config=kvpush_transfer_config(role, engine_id, control_plane), cpu_list=cpu,
                                                log_path=tmp_path / f"{role}.log")], model)
        prefill, decode = servers
        free_before = (free_kv_blocks(prefill.url), free_kv_blocks(decode.url))
        result = dispatch(prefill.url, "prefill-m", decode.url, "decode-d", prompt_token_ids(300, seed=1), MAX_TOKENS)
        assert isinstance(result.decode, HttpError), result.decode  # D's request ends, with no output
        transfer = get_transfer(control_plane, result.transfer_id)
        assert transfer.state == transfer_pb2.TRANSFER_STATE_FAILED
        assert "prefill engine's KV cache is MLA (a latent of 576" in transfer.detail and "decode engine's is full attention" in transfer.detail

        def blocks_back():
            for server in servers:  # vLLM publishes the gauge from engine steps
                completions(server.url, prompt_token_ids(4, seed=7), 1)
            return (free_kv_blocks(prefill.url), free_kv_blocks(decode.url)) == free_before or None

        wait_for(blocks_back, 15, interval=0.5, what=f"free blocks back to {free_before}")
    finally:
        for server in servers:
            server.stop()
        control_plane.stop()
