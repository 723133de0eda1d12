# SPDX-License-Identifier: Apache-2.0
"""Bytes and WRITEs per request against prompt length for the sliding-window hybrid (kvpush, real engines).

Starts kvpush's stack on the tiny Gemma-3-style model (layer 0 a 64-token
sliding window, layer 1 full attention, vLLM-CPU's 128-token blocks), sends
prompts of growing length one at a time, and prints, per request, the
broker's bytes written and the WRITE results (one per producer rank: each
carries both groups' segments), beside what moving the window's layer
whole would cost (the full layer's bytes again). The sliding group's
share is the bytes beyond the full group's whole blocks.

    python -m bench.window_bytes --out DIR [--lengths 200,400,800,1600,3200]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvpush.dev.localstack.control_plane import kvpush_transfer_config, start_control_plane
from kvpush.dev.localstack.engines import start_vllm_servers
from kvpush.dev.localstack.prompts import prompt_token_ids
from kvpush.dev.localstack.transfers import dispatch, get_transfer
from kvpush.dev.tinymodel import build_tiny_model, default_model_dir
from kvpush.rendezvous.v1 import transfer_pb2

BLOCK_SIZE = 128
LAYER_BYTES_PER_TOKEN = 2 * 2 * 64 * 4  # planes x KV heads x head size x float32


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.window_bytes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for window_bytes.json and the engines' logs")
    parser.add_argument("--lengths", default="200,400,800,1600,3200", help="comma-separated prompt lengths in tokens")
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(default_model_dir("gemma3"), arch="gemma3")
    control_plane = start_control_plane(args.out / "control-plane", engine_ids=("prefill-0", "decode-0"))
    servers = []
    rows = []
    try:
        servers = start_vllm_servers([dict(name=role, kv_transfer_config=kvpush_transfer_config(role, f"{role}-0", control_plane), cpu_list=cpu,
                                           log_path=args.out / f"{role}.log") for role, cpu in (("prefill", "0"), ("decode", "1"))], model)
        prefill, decode = servers
        for n in lengths:
            result = dispatch(prefill.url, "prefill-0", decode.url, "decode-0", prompt_token_ids(n, seed=n), 2)
            if isinstance(result.decode, Exception):
                raise SystemExit(f"prompt of {n} tokens failed: {result.decode}")
            transfer = get_transfer(control_plane, result.transfer_id)
            writes = [e for e in transfer.timeline if e.kind == transfer_pb2.TIMELINE_ENTRY_KIND_WRITE_RESULT]
            full = -(-(n - 1) // BLOCK_SIZE) * BLOCK_SIZE * LAYER_BYTES_PER_TOKEN  # whole blocks of every token but the last
            rows.append({"prompt_tokens": n, "bytes": transfer.bytes_written, "full_group_bytes": full,
                         "sliding_group_bytes": transfer.bytes_written - full, "window_moved_whole_bytes": 2 * full,
                         "write_results": len(writes)})
    finally:
        for server in servers:
            server.stop()
        control_plane.stop()
    (args.out / "window_bytes.json").write_text(json.dumps(rows, indent=1))
    print("| prompt tokens | bytes per request | full group | sliding group | window layer moved whole | WRITEs |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['prompt_tokens']:,} | {r['bytes']:,} | {r['full_group_bytes']:,} | {r['sliding_group_bytes']:,} | "
              f"{r['window_moved_whole_bytes']:,} | {r['write_results']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
