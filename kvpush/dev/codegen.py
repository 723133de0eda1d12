# SPDX-License-Identifier: Apache-2.0
"""Generates the Python protobuf and gRPC modules from protos/.

The proto root is the Python import root (protos/kvpush/x/v1/*.proto becomes
kvpush/x/v1/*_pb2.py), so generated imports need no rewriting.
"""

from __future__ import annotations

import argparse
import importlib.resources
import pathlib
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]  # kvpush/dev/codegen.py
PROTO_ROOT = REPO_ROOT / "protos"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files(proto_root: pathlib.Path = PROTO_ROOT) -> list[pathlib.Path]:
    return sorted(proto_root.rglob("*.proto"))


def generate(out_dir: pathlib.Path, proto_root: pathlib.Path = PROTO_ROOT) -> list[pathlib.Path]:
    """Runs protoc into out_dir and returns the files it wrote."""
    from grpc_tools import protoc

    well_known = importlib.resources.files("grpc_tools") / "_proto"
    files = proto_files(proto_root)
    args = [
        "protoc",
        f"-I{proto_root}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(f) for f in files],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    written = []
    for proto in files:
        stem = proto.relative_to(proto_root).with_suffix("")
        for suffix in GENERATED_SUFFIXES:
            path = out_dir / (str(stem) + suffix)
            if path.exists():
                written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=REPO_ROOT, help="output root (default: repo root)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
