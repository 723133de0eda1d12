# SPDX-License-Identifier: Apache-2.0
"""Builds the deterministic tiny random-weight models used by tests, the demo and benchmarks.

One builder, one architecture argument (`ARCHITECTURES`):

- `qwen3` (the default): a 2-layer Qwen3 (hidden 256, 4 query heads and 2
  KV heads of size 64, so TP 2 works): dense full attention, a key and a
  value plane per layer.
- `deepseek_v2`: a 2-layer DeepSeek-V2-style MLA model (hidden 256, 4 heads,
  `kv_lora_rank` 512 + `qk_rope_head_dim` 64 = a 576-element latent per token
  and layer, the one size vLLM's CPU MLA decode kernel compiles for; dense
  MLPs): one latent plane per layer, the same on every TP rank. vLLM's CPU
  platform runs it with block size 16 and turns prefix caching and chunked
  prefill off.
- `gemma3`: a 2-layer Gemma-3-style text model (`Gemma3ForCausalLM`,
  model_type `gemma3_text`; hidden 256, 4 query heads and 2 KV heads of size
  64, so TP 2 works): layer 0 is sliding-window attention over the last
  `sliding_window` = 64 tokens, layer 1 full attention, so vLLM makes two KV
  cache groups (a sliding-window one and a full one), a key and a value plane
  per layer. vLLM's CPU platform runs it with block size 128 and the hybrid
  KV cache manager on: both groups take blocks from one pool over one
  buffer, and the sliding group's blocks below the window are replaced by the
  null block 0. Gemma's norms scale by `1 + weight` and its embeddings are
  multiplied by sqrt(hidden): norm weights are stored as zeros and the
  embedding std is divided by sqrt(hidden) so that every family starts its
  residual stream at the same scale.
- `nemotron_h`: a 3-layer NemotronH-style hybrid (`NemotronHForCausalLM`,
  model_type `nemotron_h`, `hybrid_override_pattern` "M*-", hidden 256): layer
  0 a Mamba2 mixer (8 SSM heads of 32, 2 groups, state size 64, conv kernel
  4, so heads and groups split over TP 2), layer 1 attention without RoPE (4
  query heads and 2 KV heads of size 64), layer 2 a relu2 MLP with no cache.
  vLLM makes two KV cache groups over one block pool and one buffer: a full
  attention one (block size 128, a key and a value plane for layer 1) and a
  Mamba one holding one block per request: layer 0's state after the
  request's last computed token, a conv state of the last 3 inputs (conv_dim
  512) and an SSM state (8, 32, 64), both float32, 71,680 bytes (half of it
  on each TP 2 rank) padded to the attention page. The state cannot be
  rolled back a token, so a P/D transfer must carry the state after the
  tokens D does not compute itself. Run it with prefix caching off: on
  vLLM-CPU prefix caching turns on Mamba "align" mode, whose Mamba2 mixer
  fails on prompts longer than one 128-token chunk. Weights use the released
  checkpoints' names (`backbone.`, `A_log`, ...); the per-head constants are
  drawn too: A = -exp(A_log) in [-16, -1], the dt bias is softplus^-1 of a
  log-uniform dt in [0.001, 0.1] and D is in [0.5, 1.5].

All share a byte-level BPE tokenizer trained on a built-in corpus. Every
tensor is drawn from its own `torch.Generator`, seeded from `(architecture,
seed, tensor name)`, and written in float32 with safetensors, so the same
seed gives byte-identical files on any machine. Weights are scaled well
above the usual 0.02 so that greedy output depends on the prompt and
per-token logprobs move when any part of the context changes (with default
init a random model repeats one token whatever it is given).

`kvpush-model.json` in the model folder records the architecture, the seed,
the config and the sha256 of every file; `build_tiny_model` skips the build
when it matches.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

MANIFEST = "kvpush-model.json"
WEIGHTS = "model.safetensors"
# Bump when the generator changes in a way that changes the files.
BUILDER_VERSION = 1

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_VOCAB_SIZE = 4096

# What both families share (config.json is written with sorted keys, so the
# split changes no file).
_COMMON_CONFIG: dict = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": "float32",
    "use_cache": True,
}

QWEN3_CONFIG: dict = {
    **_COMMON_CONFIG,
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "num_key_value_heads": 2,
    "head_dim": 64,
    "use_sliding_window": False,
    "sliding_window": None,
}

DEEPSEEK_V2_CONFIG: dict = {
    **_COMMON_CONFIG,
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "num_key_value_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "n_routed_experts": 4,
    "first_k_dense_replace": 2,  # = num_hidden_layers: every MLP dense, no expert weights
}

GEMMA3_SLIDING_WINDOW = 64

GEMMA3_CONFIG: dict = {
    # Gemma names the activation `hidden_activation` and keeps one RoPE per layer type.
    **{key: value for key, value in _COMMON_CONFIG.items() if key not in ("hidden_act", "rope_parameters")},
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 64,  # attention scale 1/sqrt(head_dim), as for qwen3
    "layer_types": ["sliding_attention", "full_attention"],
    "sliding_window": GEMMA3_SLIDING_WINDOW,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "use_bidirectional_attention": False,
}

NEMOTRON_H_CONFIG: dict = {
    # NemotronH names its norm epsilon `layer_norm_epsilon` and its attention has no RoPE.
    **{key: value for key, value in _COMMON_CONFIG.items() if key not in ("hidden_act", "rms_norm_eps", "rope_parameters")},
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "hybrid_override_pattern": "M*-",  # Mamba2, attention, MLP
    "num_hidden_layers": 3,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "layer_norm_epsilon": 1e-6,
    "mlp_hidden_act": "relu2",
    "mlp_bias": False,
    "mamba_num_heads": 8,
    "mamba_head_dim": 32,  # intermediate 8 * 32 = 256 = hidden * expand
    "expand": 1,
    "n_groups": 2,
    "ssm_state_size": 64,
    "conv_kernel": 4,
    "chunk_size": 128,
    "mamba_hidden_act": "silu",
    "use_conv_bias": True,
    "use_bias": False,
    "mamba_ssm_cache_dtype": "float32",
    "residual_in_fp32": False,
    "sliding_window": None,
    "num_logits_to_keep": 1,
}

# Standard deviation of each weight kind (an architecture may override some); norms are its unit scale.
INIT_STD: dict[str, float] = {
    "embed_tokens": 1.0,
    "embeddings": 1.0,
    "q_proj": 0.5,
    "k_proj": 0.5,
    "v_proj": 0.5,
    "o_proj": 0.5,
    "kv_a_proj_with_mqa": 0.5,
    "kv_b_proj": 0.5,
    "gate_proj": 0.5,
    "up_proj": 0.5,
    "down_proj": 0.5,
    "lm_head": 0.5,
    "in_proj": 0.5,
    "conv1d": 0.5,
    "out_proj": 0.5,
}
EMBEDDING_KINDS = ("embed_tokens", "embeddings")  # their std is not divided by sqrt(fan_in)


# NemotronH's per-head SSM constants and conv bias (name suffix -> values from a U(0, 1) draw `u`), in HF's init ranges.
def _nemotron_h_dt_bias(u):
    dt = (math.log(1e-3) + u * (math.log(0.1) - math.log(1e-3))).exp()  # log-uniform in [0.001, 0.1]
    return dt + (-(-dt).expm1()).log()  # softplus^-1(dt)


NEMOTRON_H_VECTOR_INIT: dict[str, Callable] = {
    ".A_log": lambda u: (1.0 + 15.0 * u).log(),  # A = -exp(A_log) in [-16, -1]
    ".dt_bias": _nemotron_h_dt_bias,
    ".D": lambda u: 0.5 + u,
    ".conv1d.bias": lambda u: 0.2 * u - 0.1,
}


def _common_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    h, v, inter = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
    return shapes


def _qwen3_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    h, hd = config["hidden_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    shapes = _common_shapes(config)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn."
        shapes.update({
            p + "q_proj.weight": (q, h),
            p + "k_proj.weight": (kv, h),
            p + "v_proj.weight": (kv, h),
            p + "o_proj.weight": (h, q),
            p + "q_norm.weight": (hd,),
            p + "k_norm.weight": (hd,),
        })
    return shapes


def _deepseek_v2_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    h, heads, rank = config["hidden_size"], config["num_attention_heads"], config["kv_lora_rank"]
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    shapes = _common_shapes(config)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn."
        shapes.update({
            p + "q_proj.weight": (heads * (nope + rope), h),
            p + "kv_a_proj_with_mqa.weight": (rank + rope, h),
            p + "kv_a_layernorm.weight": (rank,),
            p + "kv_b_proj.weight": (heads * (nope + v), rank),
            p + "o_proj.weight": (h, heads * v),
        })
    return shapes


def _gemma3_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    shapes = _qwen3_shapes(config)  # the same projections and per-head q/k norms
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "pre_feedforward_layernorm.weight": (config["hidden_size"],),
            p + "post_feedforward_layernorm.weight": (config["hidden_size"],),
        })
    return shapes


def _nemotron_h_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    # The released checkpoints' names (`backbone.`, `embeddings`, `A_log`); vLLM maps them to its own.
    h, v, hd = config["hidden_size"], config["vocab_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    heads, inner = config["mamba_num_heads"], config["mamba_num_heads"] * config["mamba_head_dim"]
    conv_dim = inner + 2 * config["n_groups"] * config["ssm_state_size"]
    shapes: dict[str, tuple[int, ...]] = {"backbone.embeddings.weight": (v, h), "backbone.norm_f.weight": (h,),
                                          "lm_head.weight": (v, h)}
    for i, kind in enumerate(config["hybrid_override_pattern"]):
        p = f"backbone.layers.{i}."
        shapes[p + "norm.weight"] = (h,)
        p += "mixer."
        if kind == "M":
            shapes.update({
                p + "in_proj.weight": (inner + conv_dim + heads, h),  # gate z, x B C, dt
                p + "conv1d.weight": (conv_dim, 1, config["conv_kernel"]),
                p + "conv1d.bias": (conv_dim,),
                p + "A_log": (heads,),
                p + "D": (heads,),
                p + "dt_bias": (heads,),
                p + "norm.weight": (inner,),
                p + "out_proj.weight": (h, inner),
            })
        elif kind == "*":
            shapes.update({
                p + "q_proj.weight": (q, h),
                p + "k_proj.weight": (kv, h),
                p + "v_proj.weight": (kv, h),
                p + "o_proj.weight": (h, q),
            })
        elif kind == "-":
            shapes.update({p + "up_proj.weight": (config["intermediate_size"], h),
                           p + "down_proj.weight": (h, config["intermediate_size"])})
        else:
            raise ValueError(f"unsupported NemotronH layer kind {kind!r}")
    return shapes


@dataclass(frozen=True)
class Architecture:
    """One tiny model family: its config.json base and its parameters' names and shapes (HF naming).

    `unit_norm` is the stored norm weight that scales by 1 (Gemma's norms
    multiply by `1 + weight`); `init_std` overrides `INIT_STD` per weight kind;
    `vector_init` maps a name suffix to the values of a parameter that is
    not a matrix (e.g. an SSM's per-head constants) from a U(0, 1) draw.
    """

    name: str
    config: dict
    weight_shapes: Callable[[dict], dict[str, tuple[int, ...]]]
    unit_norm: float = 1.0
    init_std: dict[str, float] = field(default_factory=dict)
    vector_init: dict[str, Callable] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        """The model folder's default name."""
        return "tiny-" + self.name.replace("_", "-")


ARCHITECTURES = {
    "qwen3": Architecture("qwen3", QWEN3_CONFIG, _qwen3_shapes),
    "deepseek_v2": Architecture("deepseek_v2", DEEPSEEK_V2_CONFIG, _deepseek_v2_shapes),
    # Gemma multiplies the embeddings by sqrt(hidden_size) = 16.
    "gemma3": Architecture("gemma3", GEMMA3_CONFIG, _gemma3_shapes, unit_norm=0.0,
                           init_std={"embed_tokens": INIT_STD["embed_tokens"] / GEMMA3_CONFIG["hidden_size"] ** 0.5}),
    # No q/k norm: smaller q and k keep the attention soft; the depthwise conv (fan-in 4) gets weights of std 0.5.
    "nemotron_h": Architecture("nemotron_h", NEMOTRON_H_CONFIG, _nemotron_h_shapes,
                               init_std={"q_proj": 0.15, "k_proj": 0.15, "conv1d": 1 / 16},
                               vector_init=NEMOTRON_H_VECTOR_INIT),
}
DEFAULT_ARCHITECTURE = "qwen3"


def architecture(name: str) -> Architecture:
    """The named architecture, or a ValueError listing the known ones."""
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ValueError(f"unknown tiny-model architecture {name!r}; known: {', '.join(sorted(ARCHITECTURES))}") from None


def architecture_of(config: dict) -> Architecture:
    """The architecture a config.json belongs to (by its `model_type`)."""
    for arch in ARCHITECTURES.values():
        if arch.config["model_type"] == config["model_type"]:
            return arch
    raise ValueError(f"no tiny-model architecture has model_type {config['model_type']!r}")


CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_WORDS = (
    "the of and to in is that it for was on are as with by be at this have from or one had not but what all "
    "were when we there can an your which their said if do will each about how up out them then she many some "
    "so these would other into has more her two like him see time could no make than first been its who now "
    "people my made over did down only way find use may water long little very after words called just where "
    "most know get through back much before go good new write our used me man too any day same right look "
    "think also around another came come work three word must because does part even place well such here take "
    "why things help put years different away again off went old number great tell men say small every found "
    "still between name should home big give air line set own under read last never us left end along while "
    "might next sound below saw something thought both few those always looked show large often together asked "
    "house world going want school important until form food keep children feet land side without boy once "
    "animals life enough took sometimes four head above kind began almost live page got earth need far hand "
    "high year mother light parts country father let night following picture being study second eyes soon "
    "times story boys since white days ever paper hard near sentence better best across during today others "
    "however sure means knew try told young miles sun ways thing whole hear example heard several change answer "
    "room sea against top turned learn point city play toward five using himself usually cache prefill decode "
    "engine transfer block tensor request latency token worker scheduler router broker registrar stream write"
).split()
_ONSETS = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z", "br", "ch",
           "cl", "dr", "gr", "pl", "qu", "sh", "st", "th", "tr", "str"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "y", "ee", "oo"]
_CODAS = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ck", "ng", "x", "rk"]
_PUNCT = [".", ",", ";", ":", "!", "?"]


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
    repo_root = Path(__file__).resolve().parents[1]
    if (repo_root / "pyproject.toml").is_file():
        return repo_root / "models" / name
    return Path.home() / ".cache" / "kvpush" / "models" / name


def corpus(num_sentences: int = 6000) -> list[str]:
    """The deterministic tokenizer training corpus.

    Sentences of common English words mixed with pseudo-words built from
    syllables, numbers and punctuation, drawn with a fixed `random.Random`.
    The corpus does not depend on the model seed, so the tokenizer is the
    same for every seed.
    """
    rng = random.Random(20240607)
    pseudo = sorted({
        "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(rng.randint(1, 3)))
        for _ in range(3000)
    } - {""})
    lines = []
    for _ in range(num_sentences):
        words = []
        for _ in range(rng.randint(6, 18)):
            roll = rng.random()
            if roll < 0.6:
                words.append(rng.choice(_WORDS))
            elif roll < 0.92:
                # Zipf-like: early pseudo-words are much more frequent.
                words.append(pseudo[min(int(rng.paretovariate(1.0)) - 1, len(pseudo) - 1)
                                    if rng.random() < 0.5 else rng.randrange(len(pseudo))])
            else:
                words.append(str(rng.randint(0, 10 ** rng.randint(1, 5))))
        text = " ".join(words)
        lines.append(text[0].upper() + text[1:] + rng.choice(_PUNCT))
    return lines


def build_tokenizer():
    """Trains the byte-level BPE tokenizer; returns a transformers PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=QWEN3_CONFIG["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )


def model_config(vocab_size: int, eos_token_id: int, pad_token_id: int, arch: str = DEFAULT_ARCHITECTURE) -> dict:
    """The `config.json` contents for a tokenizer of `vocab_size` tokens."""
    return {**architecture(arch).config, "vocab_size": vocab_size, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id,
            "bos_token_id": None}


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
    print(f"{out} sha256={read_manifest(out)['sha256']}")
    return 0
