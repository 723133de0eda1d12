# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""`python -m bench.chaos`: the command line of a chaos run."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

from bench import chaos
from bench.chaos.runner import fault_list, run_and_report
from bench.chaos.settings import FAULTS, long_settings, short_settings


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=chaos.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--long", action="store_true", help="every fault, a minute of load before and after each, and the memory soak")
    parser.add_argument("--faults", help=f"comma-separated faults, in order (known: {', '.join(FAULTS)}; '' for none: only the soak)")
    parser.add_argument("--clients", type=int, help="concurrent client threads")
    parser.add_argument("--timeout-ms", type=int, help="the router's --transfer-timeout-ms: every request's deadline")
    parser.add_argument("--pre", type=float, help="seconds of load before each fault")
    parser.add_argument("--post", type=float, help="seconds of load after the router serves again")
    parser.add_argument("--cut", type=float, help="seconds the proxy stays cut")
    parser.add_argument("--stop", type=float, help="seconds P stays SIGSTOPped")
    parser.add_argument("--soak", type=int, help="transfer attempts held in flight in the memory soak (0: none)")
    parser.add_argument("--run-dir", type=Path, help="where logs and result.json go (default runs/chaos-<timestamp>)")
    parser.add_argument("--model-dir", type=Path, help="the tiny model (built if missing)")
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON to PATH ('-' for stdout, after the report)")
    args = parser.parse_args(argv)
    settings = long_settings() if args.long else short_settings()
    overrides = {
        "faults": fault_list(args.faults) if args.faults is not None else None, "clients": args.clients, "timeout_ms": args.timeout_ms, "pre_s": args.pre,
        "post_s": args.post, "cut_s": args.cut, "stop_s": args.stop, "soak_attempts": args.soak, "run_dir": args.run_dir, "model_dir": args.model_dir,
    }
    settings = dataclasses.replace(settings, **{k: v for k, v in overrides.items() if v is not None})
    return run_and_report(settings, args.json, "chaos")


if __name__ == "__main__":
    sys.exit(main())
