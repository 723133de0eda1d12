# SPDX-License-Identifier: Apache-2.0
"""Upstream vLLM P/D baselines on this machine: NIXL pull and push, with minimal routers.

The engines are a `kvpush.dev.localstack` stack of mode "pull" or
"upstream-push" without a router (see `kvpush.dev.localstack.upstream`):

* pull: the router sends P a non-streaming `max_tokens=1` leg with
  `do_remote_decode`, then streams D with the `kv_transfer_params` P
  returned (D READs the KV).
* push: the router sends both legs at once with the same `X-Request-Id`
  (0.32 matches P and D requests on it); D's `kv_transfer_params` carry P's
  coordinates so D registers its blocks while P computes, and P WRITEs into
  them.

`poll_delay_us` puts `bench/engine_hooks` on the engines' PYTHONPATH, so
NIXL's UCX progress thread sleeps up to that long in `poll()` instead of
spinning (the "spin removed" variant); `None` runs upstream as shipped.

`python -m bench.upstream` (from the repository root) checks both modes
against a single engine and prints TTFTs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvpush.dev.localstack.completions import Completion, completions, max_logprob_diff, max_logprob_shift, stream_completions
from kvpush.dev.localstack.engines import reference_run
from kvpush.dev.localstack.prompts import control_prompt, prompt_token_ids
from kvpush.dev.localstack.stack import Stack, StackSpec
from kvpush.dev.localstack.upstream import PREFILL_ENGINE_ID, SIDE_CHANNEL_HOST
from kvpush.services.router.core import PULL_PREFILL_PARAMS

ENGINE_HOOKS_DIR = Path(__file__).resolve().parent / "engine_hooks"
# This module's names of the upstream modes -> the local stack's.
STACK_MODES = {"pull": "pull", "push": "upstream-push"}


def engine_hooks_env(*, poll_delay_us: int | None = None, vllm_spin_ms: float | None = None, step_timeline_dir: Path | None = None) -> dict[str, str]:
    """Engine environment for `bench/engine_hooks` ({} when none is given).

    `poll_delay_us` gives NIXL's progress thread a poll delay (None: as
    shipped, busy-polling); `vllm_spin_ms` bounds how long vLLM's
    shared-memory queue readers spin per wait (None: vLLM's 1 s after each
    read); `step_timeline_dir` gets every engine process's step timeline.
    """
    env = {}
    if step_timeline_dir is not None:
        env["KVPUSH_STEP_TIMELINE_DIR"] = str(step_timeline_dir)
    if poll_delay_us is not None:
        env["KVPUSH_NIXL_PTHR_DELAY_US"] = str(poll_delay_us)
    if vllm_spin_ms is not None:
        env["KVPUSH_VLLM_SPIN_MS"] = f"{vllm_spin_ms:g}"
    if env:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ENGINE_HOOKS_DIR), os.environ.get("PYTHONPATH")) if p)
    return env


def upstream_spec(mode: str, *, poll_delay_us: int | None = 1000, prefill_cpus: str | None = None, decode_cpus: str | None = None,
                  router: bool = False, **spec_fields) -> StackSpec:
    """The stack of one upstream mode ("pull" or "push"), by default without a router (this module's routers send the legs)."""
    return StackSpec(mode=STACK_MODES[mode], prefill_cpus=prefill_cpus, decode_cpus=decode_cpus, engine_env=engine_hooks_env(poll_delay_us=poll_delay_us),
                     router=router, **spec_fields)


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


def pull_route(stack: Stack, prompt: str | Sequence[int], max_tokens: int) -> Routed:
    """Upstream pull router: P leg (`max_tokens=1`), then D streams with P's `kv_transfer_params`."""
    t0 = time.monotonic()
    headers = {"X-Request-Id": uuid.uuid4().hex}
    prefill = completions(stack.prefill.url, prompt, 1, kv_transfer_params=PULL_PREFILL_PARAMS, headers=headers)
    prefill_leg_s = time.monotonic() - t0
    if not prefill.kv_transfer_params:
        raise RuntimeError("P returned no kv_transfer_params: is it running NixlConnector as kv_producer?")
    decode = stream_completions(stack.decode.url, prompt, max_tokens, kv_transfer_params=prefill.kv_transfer_params,
                                headers=headers, t0=t0)
    return Routed(decode=decode, prefill=prefill, prefill_leg_s=prefill_leg_s)


def push_decode_params(stack: Stack, request_id: str, *, tp_size: int = 1, pp_size: int = 1) -> dict:
    """D leg `kv_transfer_params` of the upstream push router (P's coordinates and TP/PP sizes)."""
    return {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_engine_id": PREFILL_ENGINE_ID,
        "remote_host": SIDE_CHANNEL_HOST,
        "remote_port": stack.side_channel_ports[PREFILL_ENGINE_ID],
        "tp_size": tp_size,
        "pp_size": pp_size,
        "remote_request_id": request_id,
    }


def push_route(stack: Stack, prompt: str | Sequence[int], max_tokens: int,
               executor: ThreadPoolExecutor, *, tp_size: int = 1, pp_size: int = 1) -> Routed:
    """Upstream push router: both legs at once with one `X-Request-Id`; D streams back.

    The P leg runs on `executor`; its response is awaited after D finishes,
    as in upstream's demo proxy.
    """
    t0 = time.monotonic()
    request_id = uuid.uuid4().hex
    headers = {"X-Request-Id": request_id}

    def prefill_leg() -> tuple[Completion, float]:
        out = completions(stack.prefill.url, prompt, 1, kv_transfer_params=PULL_PREFILL_PARAMS, headers=headers)
        return out, time.monotonic() - t0

    future = executor.submit(prefill_leg)
    decode = stream_completions(stack.decode.url, prompt, max_tokens,
                                kv_transfer_params=push_decode_params(stack, request_id, tp_size=tp_size, pp_size=pp_size),
                                headers=headers, t0=t0)
    prefill, prefill_leg_s = future.result()
    return Routed(decode=decode, prefill=prefill, prefill_leg_s=prefill_leg_s)


def route(stack: Stack, prompt: str | Sequence[int], max_tokens: int, executor: ThreadPoolExecutor, *, tp_size: int = 1,
          pp_size: int = 1) -> Routed:
    """Routes one request with the router matching the stack's mode (P's TP/PP sizes for push)."""
    if stack.spec.mode == "pull":
        return pull_route(stack, prompt, max_tokens)
    return push_route(stack, prompt, max_tokens, executor, tp_size=tp_size, pp_size=pp_size)


def check_against_reference(model_dir: Path, modes: Sequence[str], *, prompt_lens: Sequence[int] = (256, 1024),
                            max_tokens: int = 16, repeats: int = 5, poll_delay_us: int | None = 1000,
                            prefill_cpus: str | None = None, decode_cpus: str | None = None,
                            log_dir: Path | None = None, atol: float = 1e-3) -> bool:
    """Routes fixed prompts through each mode and compares with a single engine; prints TTFTs.

    Requests are sent one at a time, after one warm-up request per stack.

    Returns True when every routed output has the reference token ids and
    logprobs within `atol`.
    """
    prompts = [prompt_token_ids(n, seed=n) for n in prompt_lens]
    prompts += [control_prompt(prompts[0])]
    reference = reference_run(model_dir, prompts, max_tokens, log_path=None if log_dir is None else Path(log_dir) / "reference.log")
    print(f"control prompt moves logprobs by {max_logprob_shift(reference[0], reference[-1]):.3f}")
    ok = True
    work = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="kvpush-upstream-"))
    for mode in modes:
        spec = upstream_spec(mode, poll_delay_us=poll_delay_us, prefill_cpus=prefill_cpus, decode_cpus=decode_cpus)
        with Stack(spec, model_dir, work / mode) as stack, ThreadPoolExecutor(max_workers=4) as pool:
            stack.start()
            print(f"{mode}: P up in {stack.prefill.start_seconds:.1f} s, D in {stack.decode.start_seconds:.1f} s; "
                  f"idle cores P {stack.prefill.idle_cores(3):.2f} D {stack.decode.idle_cores(3):.2f}")
            # The first request pays for the NIXL handshake and connection setup.
            warmup = route(stack, prompts[0], max_tokens, pool)
            ok &= max_logprob_diff(reference[0], warmup.decode) <= atol
            print(f"  {mode} warm-up TTFT {warmup.ttft_s * 1000:.0f} ms")
            for prompt, ref in zip(prompts, reference):
                ttfts, diff = [], 0.0
                for _ in range(repeats):
                    routed = route(stack, prompt, max_tokens, pool)
                    diff = max(diff, max_logprob_diff(ref, routed.decode))
                    ttfts.append(routed.ttft_s * 1000)
                ok &= diff <= atol
                print(f"  {mode} in={len(prompt)}: max |dlogprob| {diff:.2e}, "
                      f"TTFT ms p50 {statistics.median(ttfts):.1f} (all {', '.join(f'{t:.0f}' for t in ttfts)}), "
                      f"P leg {routed.prefill_leg_s * 1000:.1f} ms")
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: check upstream pull/push against a single engine on the tiny model."""
    from kvpush.dev.tinymodel import build_tiny_model, default_model_dir

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
