# SPDX-License-Identifier: Apache-2.0
"""The tiny models' weights: every tensor drawn from its own generator, seeded from `(architecture, seed, tensor name)`.

Weights are scaled well above the usual 0.02 so that greedy output depends
on the prompt and per-token logprobs move when any part of the context
changes (with default init a random model repeats one token whatever it is
given).
"""

from __future__ import annotations

import hashlib
import math

from kvpush.dev.tinymodel.architectures import EMBEDDING_KINDS, INIT_STD, architecture_of


def weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Names and shapes of every parameter of the config's architecture, in HF naming."""
    return architecture_of(config).weight_shapes(config)


def make_weights(config: dict, seed: int) -> dict:
    """Draws every tensor from a generator seeded by `(architecture, seed, name)`.

    Linear weights are normal with the `INIT_STD` of their kind (or the
    architecture's override) times 16 (sqrt of the hidden size) over
    sqrt(fan_in) (embeddings are not divided); norms hold the
    architecture's unit scale (ones; zeros for Gemma's `1 + weight` norms);
    the architecture's `vector_init` parameters are a function of a uniform
    draw.
    """
    import torch

    arch = architecture_of(config)
    label = arch.name
    tensors = {}
    for name, shape in sorted(weight_shapes(config).items()):
        if name.endswith(("norm.weight", "norm_f.weight")):
            tensors[name] = torch.full(shape, arch.unit_norm, dtype=torch.float32)
            continue
        digest = hashlib.sha256(f"kvpush-tiny-{label}:{seed}:{name}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2 ** 63 - 1))
        vector_init = next((f for suffix, f in arch.vector_init.items() if name.endswith(suffix)), None)
        if vector_init is not None:
            tensors[name] = vector_init(torch.rand(shape, generator=gen, dtype=torch.float32)).to(torch.float32)
            continue
        kind = name.split(".")[-2]
        base = arch.init_std.get(kind, INIT_STD[kind])
        std = base if kind in EMBEDDING_KINDS else base * 16.0 / math.prod(shape[1:]) ** 0.5
        tensors[name] = torch.randn(shape, generator=gen, dtype=torch.float32) * std
    return tensors
