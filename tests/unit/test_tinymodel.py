# SPDX-License-Identifier: Apache-2.0
"""The tiny model builds deterministically, its tokenizer round-trips, and it runs and depends on its context."""

from __future__ import annotations

import json

import pytest

from kvpush.dev import tinymodel

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Two builds of seed 0 into separate folders, plus one of seed 1."""
    root = tmp_path_factory.mktemp("models")
    return (tinymodel.build_tiny_model(root / "a", seed=0), tinymodel.build_tiny_model(root / "b", seed=0),
            tinymodel.build_tiny_model(root / "c", seed=1))


def test_same_seed_gives_identical_files(built):
    a, b, c = built
    manifest_a, manifest_b = tinymodel.read_manifest(a), tinymodel.read_manifest(b)
    assert manifest_a["sha256"] == manifest_b["sha256"]
    assert manifest_a["files"] == manifest_b["files"]
    assert (a / tinymodel.WEIGHTS).read_bytes() == (b / tinymodel.WEIGHTS).read_bytes()
    assert tinymodel.read_manifest(c)["sha256"] != manifest_a["sha256"]


def test_manifest_records_seed_and_config(built):
    a, _, c = built
    manifest = tinymodel.read_manifest(a)
    assert manifest["seed"] == 0 and tinymodel.read_manifest(c)["seed"] == 1
    assert manifest["config"] == json.loads((a / "config.json").read_text())
    assert manifest["config"]["num_key_value_heads"] == 2 and manifest["config"]["head_dim"] == 64


def test_rebuild_is_skipped_when_current(built):
    a, _, _ = built
    mtime = (a / tinymodel.WEIGHTS).stat().st_mtime_ns
    assert tinymodel.build_tiny_model(a, seed=0) == a
    assert (a / tinymodel.WEIGHTS).stat().st_mtime_ns == mtime


def test_rebuild_replaces_other_seed_or_damaged_files(tmp_path):
    out = tinymodel.build_tiny_model(tmp_path / "m", seed=1)
    tinymodel.build_tiny_model(out, seed=0)
    assert tinymodel.read_manifest(out)["seed"] == 0
    (out / tinymodel.WEIGHTS).write_bytes(b"garbage")
    tinymodel.build_tiny_model(out, seed=0)
    assert tinymodel.file_sha256(out / tinymodel.WEIGHTS) == tinymodel.read_manifest(out)["sha256"]


def test_tokenizer_round_trips_and_has_chat_template(built):
    tok = transformers.AutoTokenizer.from_pretrained(built[0])
    for text in ["The prefill engine writes its cache into decode blocks.", "zqx 12345 ünïcødé ✓ {json: [1, 2]}\n\tend"]:
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text
    assert len(tok) == tinymodel.read_manifest(built[0])["config"]["vocab_size"]
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def run_with_control(model_dir, length: int):
    """(model, prompt, last-token logprobs twice, and those of the prompt with its first half changed)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, model.config.vocab_size, (1, length), generator=gen)
    control = prompt.clone()
    control[0, :length // 2] = torch.randint(3, model.config.vocab_size, (length // 2,), generator=gen)
    with torch.no_grad():
        runs = [model(p).logits[0, -1].log_softmax(-1) for p in (prompt, prompt, control)]
    return model, prompt, *runs


def test_model_loads_runs_and_depends_on_whole_context(built):
    model, prompt, a, again, b = run_with_control(built[0], 256)
    assert torch.equal(a, again)
    assert (a - b).abs().max().item() >= 0.05
    # Greedy next tokens vary along the prompt instead of collapsing to one token.
    with torch.no_grad():
        nexts = model(prompt).logits[0].argmax(-1)
    assert len(set(nexts.tolist())) > 50


@pytest.fixture(scope="module")
def mla_built(tmp_path_factory):
    """The MLA architecture, built twice with seed 0."""
    root = tmp_path_factory.mktemp("mla")
    return tuple(tinymodel.build_tiny_model(root / name, seed=0, arch="deepseek_v2") for name in ("a", "b"))


def test_the_mla_model_is_deterministic_with_the_latent_vllm_cpu_decodes(mla_built, built):
    a, b = mla_built
    manifest = tinymodel.read_manifest(a)
    assert manifest["sha256"] == tinymodel.read_manifest(b)["sha256"]
    assert manifest["sha256"] != tinymodel.read_manifest(built[0])["sha256"]
    config = manifest["config"]
    assert config["architectures"] == ["DeepseekV2ForCausalLM"]
    assert config["kv_lora_rank"] + config["qk_rope_head_dim"] == 576  # the CPU MLA decode kernel's one size
    assert config["first_k_dense_replace"] == config["num_hidden_layers"]  # dense MLPs: no expert weights


def test_the_mla_model_loads_and_depends_on_its_context(mla_built):
    _, _, a, again, b = run_with_control(mla_built[0], 64)
    assert torch.equal(a, again)
    assert (a - b).abs().max().item() >= 0.05


def test_an_existing_folder_of_the_other_architecture_is_rebuilt(tmp_path):
    out = tinymodel.build_tiny_model(tmp_path / "m", seed=0)
    tinymodel.build_tiny_model(out, seed=0, arch="deepseek_v2")
    assert tinymodel.read_manifest(out)["config"]["model_type"] == "deepseek_v2"


def test_an_unknown_architecture_is_refused_naming_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="deepseek_v2, gemma3, nemotron_h, qwen3"):
        tinymodel.build_tiny_model(tmp_path / "m", arch="llama")
    assert not (tmp_path / "m").exists()
