# SPDX-License-Identifier: Apache-2.0
"""Upstream vLLM P/D baselines on this machine: NIXL pull and push, with minimal routers.

* pull: `NixlConnector` (P `kv_producer`, D `kv_consumer`). The router sends
  P a non-streaming `max_tokens=1` leg with `do_remote_decode`, then streams
  D with the `kv_transfer_params` P returned (D READs the KV).
* push: `NixlPushConnector`. The router sends both legs at once with the same
  `X-Request-Id` (0.32 matches P and D requests on it); D's
  `kv_transfer_params` carry P's coordinates (engine id, side-channel
  host/port, TP/PP size) so D registers its blocks while P computes, and P
  WRITEs into them.

Both engines get `VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1` and distinct
`VLLM_NIXL_SIDE_CHANNEL_PORT`s. `poll_delay_us` puts
`bench/nixl_poll_delay` on the engines' PYTHONPATH, so NIXL's UCX progress
thread sleeps up to that long in `poll()` instead of spinning (the "spin
removed" variant); `None` runs upstream as shipped.

`python -m bench.upstream` (from the repository root) checks both modes
against a single engine and prints TTFTs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvpush.services.router.core import PULL_PREFILL_PARAMS
from tests.e2e.harness import (
    Completion,
    ServerHandle,
    completions,
    control_prompt,
    free_port,
    max_logprob_diff,
    max_logprob_shift,
    prompt_token_ids,
    reference_run,
    start_vllm_server,
    stream_completions,
)

POLL_DELAY_DIR = Path(__file__).resolve().parent / "nixl_poll_delay"
CONNECTORS = {"pull": "NixlConnector", "push": "NixlPushConnector"}
SIDE_CHANNEL_HOST = "127.0.0.1"
PREFILL_ENGINE_ID = "upstream-prefill"
DECODE_ENGINE_ID = "upstream-decode"

@dataclass
class UpstreamPair:
    """A running upstream P and D pair and what a router needs to address P."""

    mode: str
    prefill: ServerHandle
    decode: ServerHandle
    prefill_side_channel_port: int
    prefill_engine_id: str = PREFILL_ENGINE_ID
    prefill_tp_size: int = 1

    def stop(self) -> None:
        """Stops both servers."""
        for server in (self.decode, self.prefill):
            server.stop()

    def __enter__(self) -> UpstreamPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def kv_transfer_config(mode: str, role: str, engine_id: str) -> dict:
    """`--kv-transfer-config` for an upstream engine; `role` is "prefill" or "decode"."""
    return {
        "kv_connector": CONNECTORS[mode],
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_buffer_device": "cpu",
        "engine_id": engine_id,
    }


def engine_env(side_channel_port: int, poll_delay_us: int | None) -> dict[str, str]:
    """Environment of one upstream engine (side channel; optionally the poll-delay patch)."""
    env = {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": SIDE_CHANNEL_HOST,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
        # Load no vLLM general plugins (in particular not kvpush's own connector plugin).
        "VLLM_PLUGINS": "",
    }
    if poll_delay_us is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(POLL_DELAY_DIR), os.environ.get("PYTHONPATH")) if p)
        env["KVPUSH_NIXL_PTHR_DELAY_US"] = str(poll_delay_us)
    return env


def start_upstream_pair(
    model_dir: Path,
    mode: str,
    *,
    poll_delay_us: int | None = 1000,
    prefill_cpus: str | None = None,
    decode_cpus: str | None = None,
    log_dir: Path | None = None,
    env: Mapping[str, str] | None = None,
    **server_kwargs,
) -> UpstreamPair:
    """Starts P and D (concurrently) with the upstream connector of `mode` ("pull" or "push").

    `prefill_cpus`/`decode_cpus` pin the engines with taskset; extra keyword
    arguments go to `start_vllm_server` for both engines.
    """
    ports = {role: free_port() for role in ("prefill", "decode")}
    engine_ids = {"prefill": PREFILL_ENGINE_ID, "decode": DECODE_ENGINE_ID}
    cpus = {"prefill": prefill_cpus, "decode": decode_cpus}

    def start(role: str) -> ServerHandle:
        return start_vllm_server(
            model_dir,
            kv_transfer_config=kv_transfer_config(mode, role, engine_ids[role]),
            env={**engine_env(ports[role], poll_delay_us), **(env or {})},
            cpu_list=cpus[role],
            log_path=None if log_dir is None else Path(log_dir) / f"upstream-{mode}-{role}.log",
            **server_kwargs,
        )

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {role: pool.submit(start, role) for role in ports}
        started, errors = {}, []
        for role, future in futures.items():
            try:
                started[role] = future.result()
            except Exception as exc:  # stop whichever one did start before re-raising
                errors.append(exc)
    if errors:
        for server in started.values():
            server.stop()
        raise errors[0]
    return UpstreamPair(mode=mode, prefill=started["prefill"], decode=started["decode"],
                        prefill_side_channel_port=ports["prefill"])


@dataclass
class Routed:
    """One routed request: D's streamed output (TTFT from the router's send) and the P leg."""

    decode: Completion
    prefill: Completion
    prefill_leg_s: float

    @property
    def ttft_s(self) -> float:
        """Router send → first token from D."""
        return self.decode.ttft_s if self.decode.ttft_s is not None else float("nan")


def pull_route(pair: UpstreamPair, prompt: str | Sequence[int], max_tokens: int) -> Routed:
    """Upstream pull router: P leg (`max_tokens=1`), then D streams with P's `kv_transfer_params`."""
    t0 = time.monotonic()
    headers = {"X-Request-Id": uuid.uuid4().hex}
    prefill = completions(pair.prefill.url, prompt, 1, kv_transfer_params=PULL_PREFILL_PARAMS, headers=headers)
    prefill_leg_s = time.monotonic() - t0
    if not prefill.kv_transfer_params:
        raise RuntimeError("P returned no kv_transfer_params: is it running NixlConnector as kv_producer?")
    decode = stream_completions(pair.decode.url, prompt, max_tokens, kv_transfer_params=prefill.kv_transfer_params,
                                headers=headers, t0=t0)
    return Routed(decode=decode, prefill=prefill, prefill_leg_s=prefill_leg_s)


def push_decode_params(pair: UpstreamPair, request_id: str) -> dict:
    """D leg `kv_transfer_params` of the upstream push router (P's coordinates)."""
    return {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_engine_id": pair.prefill_engine_id,
        "remote_host": SIDE_CHANNEL_HOST,
        "remote_port": pair.prefill_side_channel_port,
        "tp_size": pair.prefill_tp_size,
        "pp_size": 1,
        "remote_request_id": request_id,
    }


def push_route(pair: UpstreamPair, prompt: str | Sequence[int], max_tokens: int,
               executor: ThreadPoolExecutor) -> Routed:
    """Upstream push router: both legs at once with one `X-Request-Id`; D streams back.

    The P leg runs on `executor`; its response is awaited after D finishes,
    as in upstream's demo proxy.
    """
    t0 = time.monotonic()
    request_id = uuid.uuid4().hex
    headers = {"X-Request-Id": request_id}

    def prefill_leg() -> tuple[Completion, float]:
        out = completions(pair.prefill.url, prompt, 1, kv_transfer_params=PULL_PREFILL_PARAMS, headers=headers)
        return out, time.monotonic() - t0

    future = executor.submit(prefill_leg)
    decode = stream_completions(pair.decode.url, prompt, max_tokens,
                                kv_transfer_params=push_decode_params(pair, request_id), headers=headers, t0=t0)
    prefill, prefill_leg_s = future.result()
    return Routed(decode=decode, prefill=prefill, prefill_leg_s=prefill_leg_s)


def route(pair: UpstreamPair, prompt: str | Sequence[int], max_tokens: int, executor: ThreadPoolExecutor) -> Routed:
    """Routes one request with the router matching the pair's mode."""
    if pair.mode == "pull":
        return pull_route(pair, prompt, max_tokens)
    return push_route(pair, prompt, max_tokens, executor)


def check_against_reference(model_dir: Path, modes: Sequence[str], *, prompt_lens: Sequence[int] = (256, 1024),
                            max_tokens: int = 16, repeats: int = 5, poll_delay_us: int | None = 1000,
                            prefill_cpus: str | None = None, decode_cpus: str | None = None,
                            log_dir: Path | None = None, atol: float = 1e-3) -> bool:
    """Routes fixed prompts through each mode and compares with a single engine; prints TTFTs.

    Requests are sent one at a time, after one warm-up request per pair.

    Returns True when every routed output has the reference token ids and
    logprobs within `atol`.
    """
    prompts = [prompt_token_ids(n, seed=n) for n in prompt_lens]
    prompts += [control_prompt(prompts[0])]
    reference = reference_run(model_dir, prompts, max_tokens,
                              log_path=None if log_dir is None else Path(log_dir) / "reference.log")
    print(f"control prompt moves logprobs by {max_logprob_shift(reference[0], reference[-1]):.3f}")
    ok = True
    for mode in modes:
        with (start_upstream_pair(model_dir, mode, poll_delay_us=poll_delay_us, prefill_cpus=prefill_cpus,
                                  decode_cpus=decode_cpus, log_dir=log_dir) as pair,
              ThreadPoolExecutor(max_workers=4) as pool):
            print(f"{mode}: P up in {pair.prefill.start_seconds:.1f} s, D in {pair.decode.start_seconds:.1f} s; "
                  f"idle cores P {pair.prefill.idle_cores(3):.2f} D {pair.decode.idle_cores(3):.2f}")
            # The first request pays for the NIXL handshake and connection setup.
            warmup = route(pair, prompts[0], max_tokens, pool)
            ok &= max_logprob_diff(reference[0], warmup.decode) <= atol
            print(f"  {mode} warm-up TTFT {warmup.ttft_s * 1000:.0f} ms")
            for prompt, ref in zip(prompts, reference):
                ttfts, diff = [], 0.0
                for _ in range(repeats):
                    routed = route(pair, prompt, max_tokens, pool)
                    diff = max(diff, max_logprob_diff(ref, routed.decode))
                    ttfts.append(routed.ttft_s * 1000)
                ok &= diff <= atol
                print(f"  {mode} in={len(prompt)}: max |dlogprob| {diff:.2e}, "
                      f"TTFT ms p50 {statistics.median(ttfts):.1f} (all {', '.join(f'{t:.0f}' for t in ttfts)}), "
                      f"P leg {routed.prefill_leg_s * 1000:.1f} ms")
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: check upstream pull/push against a single engine on the tiny model."""
    from kvpush.tinymodel import build_tiny_model, default_model_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["pull", "push", "both"], default="both")
    parser.add_argument("--model", type=Path, default=None, help="model folder (built if missing)")
    parser.add_argument("--poll-delay-us", type=int, default=1000,
                        help="NIXL progress-thread poll delay; negative = upstream as shipped (spinning)")
    parser.add_argument("--prefill-cpus", default="0", help="CPU list P is pinned to ('' = not pinned; default 0)")
    parser.add_argument("--decode-cpus", default="1", help="CPU list D is pinned to ('' = not pinned; default 1)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--log-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    model_dir = build_tiny_model(args.model or default_model_dir())
    modes = ["pull", "push"] if args.mode == "both" else [args.mode]
    ok = check_against_reference(model_dir, modes, repeats=args.repeats,
                                 poll_delay_us=None if args.poll_delay_us < 0 else args.poll_delay_us,
                                 prefill_cpus=args.prefill_cpus or None, decode_cpus=args.decode_cpus or None,
                                 log_dir=args.log_dir)
    print("OK: routed outputs equal the single engine" if ok else "MISMATCH against the single engine")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
