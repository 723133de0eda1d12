# SPDX-License-Identifier: Apache-2.0
"""The `kvpush` command: one subcommand per service or tool.

Each subcommand lives in its own module exposing
`configure_parser(parser: argparse.ArgumentParser) -> None` and
`run(args: argparse.Namespace) -> int`; modules load only when used.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from kvpush.logs import LOG_FORMAT

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "control-plane": ("kvpush.services.control_plane", "run the registrar and the broker in one process (the embedded default)"),
    "registrar": ("kvpush.services.registrar.main", "run the registrar alone"),
    "broker": ("kvpush.services.broker.main", "run the rendezvous broker alone, pointed at a registrar"),
    "router": ("kvpush.services.router.main", "run the OpenAI-compatible P/D router"),
    "tokens": ("kvpush.services.common.tokens", "create the per-identity token files of a control plane's --tokens-dir"),
    "build-model": ("kvpush.dev.tinymodel", "build the deterministic tiny random-weight model"),
    "ttft-report": ("kvpush.report.ttft", "render the TTFT breakdown from OTLP traces"),
    "sim": ("kvpush.dev.sim.run", "run seeded fault-injecting simulations of the whole protocol and check its invariants"),
    "demo": ("kvpush.dev.demo", "run the local P+D+control-plane+router stack and print results"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpush", description="push-mode KV transfer for disaggregated vLLM")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # Parse only the command name here; the subcommand module owns its flags.
    known, rest = parser.parse_known_args(argv)
    module_path, help_text = SUBCOMMANDS[known.command]
    try:
        module = importlib.import_module(module_path)
    except ImportError as exc:
        print(f"kvpush {known.command}: cannot load {module_path}: {exc}", file=sys.stderr)
        return 2
    sub_parser = argparse.ArgumentParser(prog=f"kvpush {known.command}", description=help_text)
    module.configure_parser(sub_parser)
    args = sub_parser.parse_args(rest)
    logging.basicConfig(level=known.log_level.upper(), format=LOG_FORMAT)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
