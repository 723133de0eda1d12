# SPDX-License-Identifier: Apache-2.0
"""Builds the deterministic tiny random-weight models used by tests, the demo and benchmarks (`kvpush build-model`).

One builder, one architecture argument (`ARCHITECTURES` in
`kvpush.dev.tinymodel.architectures`, which describes each family): `qwen3`
(the default; dense full attention), `deepseek_v2` (MLA), `gemma3`
(sliding-window + full attention) and `nemotron_h` (a Mamba2 + attention
hybrid).

All share a byte-level BPE tokenizer trained on a built-in corpus
(`kvpush.dev.tinymodel.tokenizer`). Every tensor is drawn from its own
`torch.Generator`, seeded from `(architecture, seed, tensor name)`
(`kvpush.dev.tinymodel.weights`), and written in float32 with safetensors, so
the same seed gives byte-identical files on any machine.

`kvpush-model.json` in the model folder records the architecture, the seed,
the config and the sha256 of every file; `build_tiny_model` skips the build
when it matches.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from kvpush.dev.tinymodel.architectures import ARCHITECTURES, DEFAULT_ARCHITECTURE, architecture
from kvpush.dev.tinymodel.tokenizer import build_tokenizer
from kvpush.dev.tinymodel.weights import make_weights

MANIFEST = "kvpush-model.json"
WEIGHTS = "model.safetensors"
# Bump when the generator changes in a way that changes the files.
BUILDER_VERSION = 1


def default_model_dir(arch: str = DEFAULT_ARCHITECTURE) -> Path:
    """Where the model of an architecture lives unless told otherwise.

    `$KVPUSH_MODEL_DIR` if set (the default architecture only); else
    `models/tiny-<arch>` in the source checkout (git-ignored) when running
    from one; else `~/.cache/kvpush/models/tiny-<arch>`.
    """
    name = architecture(arch).model_name
    env = os.environ.get("KVPUSH_MODEL_DIR")
    if env and arch == DEFAULT_ARCHITECTURE:
        return Path(env)
    repo_root = Path(__file__).resolve().parents[3]  # kvpush/dev/tinymodel/__init__.py
    if (repo_root / "pyproject.toml").is_file():
        return repo_root / "models" / name
    return Path.home() / ".cache" / "kvpush" / "models" / name


def model_config(vocab_size: int, eos_token_id: int, pad_token_id: int, arch: str = DEFAULT_ARCHITECTURE) -> dict:
    """The `config.json` contents for a tokenizer of `vocab_size` tokens."""
    return {**architecture(arch).config, "vocab_size": vocab_size, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id,
            "bos_token_id": None}


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's contents."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(model_dir: Path) -> dict | None:
    """The manifest of a built model folder, or None if there is none."""
    try:
        return json.loads((Path(model_dir) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def _is_current(model_dir: Path, seed: int, arch: str) -> bool:
    manifest = read_manifest(model_dir)
    if not manifest or manifest.get("seed") != seed or manifest.get("builder_version") != BUILDER_VERSION:
        return False
    built = manifest.get("config", {})
    if any(built.get(key) != value for key, value in architecture(arch).config.items()):
        return False  # another architecture, or this one's config changed
    files = manifest.get("files", {})
    return bool(files) and all((model_dir / name).is_file() and file_sha256(model_dir / name) == digest
                               for name, digest in files.items())


def build_tiny_model(out_dir: Path, seed: int = 0, arch: str = DEFAULT_ARCHITECTURE) -> Path:
    """Builds the model of an architecture into `out_dir` (skipped if already built so) and returns `out_dir`.

    The files are written to a temporary sibling folder and renamed into
    place, so concurrent builders and readers never see a half-written model.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    architecture(arch)  # an unknown name fails before anything is written
    if _is_current(out_dir, seed, arch):
        logging.getLogger(__name__).info("model in %s is current (%s, seed %d)", out_dir, arch, seed)
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        tokenizer = build_tokenizer()
        tokenizer.save_pretrained(tmp)
        config = model_config(len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, arch)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(
            {"eos_token_id": config["eos_token_id"], "pad_token_id": config["pad_token_id"]}, indent=2) + "\n")
        save_file(make_weights(config, seed), str(tmp / WEIGHTS), metadata={"format": "pt"})
        files = {p.name: file_sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        manifest = {"builder_version": BUILDER_VERSION, "seed": seed, "sha256": files[WEIGHTS], "files": files,
                    "config": config}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        for path in tmp.iterdir():
            path.chmod(0o644)
        tmp.chmod(0o755)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logging.getLogger(__name__).info("built model in %s (seed %d, sha256 %s)", out_dir, seed, files[WEIGHTS])
    return out_dir


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Adds the `kvpush build-model` flags."""
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default=DEFAULT_ARCHITECTURE,
                        help="model family: qwen3 (dense attention, the default), deepseek_v2 (MLA), "
                             "gemma3 (sliding-window + full attention) or nemotron_h (Mamba2 + attention hybrid)")
    parser.add_argument("--out", type=Path, default=None,
                        help="model folder (default: $KVPUSH_MODEL_DIR for qwen3, else models/tiny-<arch> in the checkout)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")


def run(args: argparse.Namespace) -> int:
    """Builds the model and prints its folder and weights hash."""
    out = build_tiny_model(args.out or default_model_dir(args.arch), seed=args.seed, arch=args.arch)
    manifest = read_manifest(out)
    assert manifest is not None, "build_tiny_model writes the manifest last"
    print(f"{out} sha256={manifest['sha256']}")
    return 0
