# SPDX-License-Identifier: Apache-2.0
"""The per-identity tokens directory: loading (plain files and a Kubernetes Secret volume), refusals, creation."""

from __future__ import annotations

import pathlib

import pytest

from kvpush.services.common.config import ServerConfig
from kvpush.services.common.tokens import IdentityTokens, create_tokens, load_tokens_dir, server_tokens


def write(directory: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (directory / name).write_text(content)
    return directory


def secret_volume(directory: pathlib.Path, keys: dict[str, str]) -> pathlib.Path:
    """What kubelet makes of a Secret mounted as a volume: the keys in a timestamped folder behind `..data`, each linked."""
    write(directory / "..2026_12_01_02_00_00.123456789", keys)
    (directory / "..data").symlink_to("..2026_12_01_02_00_00.123456789")
    for name in keys:
        (directory / name).symlink_to(f"..data/{name}")
    return directory


def test_each_file_names_an_identity_and_holds_its_token(tmp_path):
    tokens = load_tokens_dir(write(tmp_path, {"router": "r-token\n", "broker": " b-token ", "prefill-0": "p-token", "decode-0.x:1": "d-token"}))
    assert tokens.identities == {"router", "broker", "prefill-0", "decode-0.x:1"}
    assert [tokens.identify(t) for t in ("r-token", "b-token", "p-token", "d-token")] == ["router", "broker", "prefill-0", "decode-0.x:1"]
    assert tokens.token_of("broker") == "b-token" and tokens.token_of("decode-1") is None


@pytest.mark.parametrize("presented", ["", "r-toke", "r-tokenx", "R-TOKEN", "p-token r-token"])
def test_only_an_exact_token_identifies(presented):
    tokens = IdentityTokens({"router": "r-token", "prefill-0": "p-token"})
    assert tokens.identify(presented) is None


def test_a_kubernetes_secret_volume_loads_with_its_data_links_skipped(tmp_path):
    tokens = load_tokens_dir(secret_volume(tmp_path, {"router": "r-token", "vllm-prefill-0": "p-token"}))
    assert tokens.identities == {"router", "vllm-prefill-0"}
    assert tokens.identify("p-token") == "vllm-prefill-0"


def test_dotfiles_and_folders_are_not_identities(tmp_path):
    write(tmp_path, {"router": "r-token", ".hidden": "h-token", ".router.1234.tmp": "t-token"})
    (tmp_path / "subfolder").mkdir()
    assert load_tokens_dir(tmp_path).identities == {"router"}


def test_duplicate_tokens_are_refused_naming_both_files(tmp_path):
    write(tmp_path, {"router": "same\n", "prefill-0": "same"})
    with pytest.raises(ValueError) as info:
        load_tokens_dir(tmp_path)
    assert f"{tmp_path / 'prefill-0'} and {tmp_path / 'router'} hold the same token" in str(info.value)


@pytest.mark.parametrize(
    "files, message",
    [
        ({"router": "  \n"}, "router is empty"),
        ({"router": "r", "bad name": "x"}, "'bad name' is not an identity"),
        ({}, "holds no identity files"),
    ],
    ids=["empty token", "not an identity", "no files"],
)
def test_a_bad_directory_is_refused_with_what_is_wrong(tmp_path, files, message):
    with pytest.raises(ValueError, match=message):
        load_tokens_dir(write(tmp_path / "tokens", files))


def test_token_mode_needs_a_directory_and_mtls_none(tmp_path):
    with pytest.raises(ValueError, match="--tokens-dir"):
        server_tokens(ServerConfig())
    with pytest.raises(ValueError, match="not a directory"):
        server_tokens(ServerConfig(tokens_dir=tmp_path / "absent"))
    mtls = ServerConfig(tls_cert=tmp_path / "c", tls_key=tmp_path / "k", tls_ca=tmp_path / "ca", tokens_dir=tmp_path / "absent")
    assert server_tokens(mtls) is None


def test_create_tokens_writes_private_random_tokens_once(tmp_path):
    directory = tmp_path / "tokens"
    assert create_tokens(directory, ["router", "prefill-0", "router"]) == ["router", "prefill-0"]
    first = {path.name: path.read_text() for path in directory.iterdir()}
    assert create_tokens(directory, ["router", "decode-0"]) == ["decode-0"]
    assert (directory / "router").read_text() == first["router"]  # kept
    assert all((directory / name).stat().st_mode & 0o777 == 0o600 for name in ("router", "prefill-0", "decode-0"))
    assert directory.stat().st_mode & 0o777 == 0o700
    tokens = load_tokens_dir(directory)
    assert len({tokens.token_of(name) for name in tokens.identities}) == 3 and all(len(tokens.token_of(name)) >= 32 for name in tokens.identities)


def test_create_tokens_refuses_a_name_that_is_no_identity_before_writing(tmp_path):
    with pytest.raises(ValueError, match="'../escape' is not an identity"):
        create_tokens(tmp_path / "tokens", ["router", "../escape"])
    assert not (tmp_path / "tokens").exists()
