# SPDX-License-Identifier: Apache-2.0
"""Per-identity tokens: a directory with one file per caller, and `kvpush tokens`, which creates it.

Each regular file's name is an identity and its content (stripped) that
identity's bearer token: `router`, `broker` (a separate broker process
reading the registrar) or an engine id. That is the shape of a Kubernetes
Secret mounted as a volume, so dotfiles and the `..data` entries Kubernetes
adds are skipped and symlinks are followed. Tokens are read once, at start.
"""

from __future__ import annotations

import argparse
import hmac
import pathlib
import secrets
import sys
from collections.abc import Iterable, Mapping

from kvpush.services.common.config import ServerConfig, write_private_file
from kvpush.services.common.validation import ID_PATTERN

ROUTER_IDENTITY = "router"
BROKER_IDENTITY = "broker"
# Identities that are not engines: they never act for one.
SERVICE_IDENTITIES = frozenset({ROUTER_IDENTITY, BROKER_IDENTITY})


def check_identity(name: str) -> None:
    """Raises ValueError unless name is `router`, `broker` or a valid engine id."""
    if name not in SERVICE_IDENTITIES and ID_PATTERN.fullmatch(name) is None:
        raise ValueError(f"{name!r} is not an identity: use 'router', 'broker' or an engine id (1 to 128 characters of [A-Za-z0-9._:-])")


class IdentityTokens:
    """Maps a presented bearer token to the identity it belongs to."""

    __slots__ = ("_entries", "_by_identity")

    def __init__(self, tokens: Mapping[str, str], *, source: pathlib.Path | None = None):
        """tokens maps identity -> token; source (the directory) only names files in errors."""

        def where(identity: str) -> str:
            return str(source / identity) if source is not None else repr(identity)

        owners: dict[str, str] = {}
        for identity, token in tokens.items():
            check_identity(identity)
            if not token:
                raise ValueError(f"the token of {where(identity)} is empty")
            if token in owners:
                # One token for two identities would let either act as the other.
                raise ValueError(f"{where(owners[token])} and {where(identity)} hold the same token; every identity needs its own")
            owners[token] = identity
        self._by_identity = dict(tokens)
        self._entries = tuple((identity, token.encode()) for identity, token in tokens.items())

    @property
    def identities(self) -> frozenset[str]:
        return frozenset(self._by_identity)

    def token_of(self, identity: str) -> str | None:
        """identity's own token (a separate broker presents `broker`'s to the registrar), or None."""
        return self._by_identity.get(identity)

    def identify(self, presented: str) -> str | None:
        """The identity whose token presented is, or None.

        Every token is compared, in constant time each, so how long this
        takes does not tell which identity (if any) nearly matched.
        """
        candidate = presented.encode()
        found = None
        for identity, token in self._entries:
            if hmac.compare_digest(candidate, token):
                found = identity
        return found


def load_tokens_dir(directory: pathlib.Path) -> IdentityTokens:
    """Reads every identity file of directory; ValueError names what is wrong."""
    if not directory.is_dir():
        raise ValueError(f"--tokens-dir {directory} is not a directory")
    tokens: dict[str, str] = {}
    for path in sorted(directory.iterdir()):
        # Kubernetes keeps the real files in `..<timestamp>` folders behind a
        # `..data` link and links each key to them; dotfiles are never identities.
        if path.name.startswith(".") or not path.is_file():
            continue
        try:
            check_identity(path.name)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        tokens[path.name] = path.read_text(encoding="utf-8").strip()
    if not tokens:
        raise ValueError(f"--tokens-dir {directory} holds no identity files (create them with `kvpush tokens --dir {directory} router ENGINE_ID ...`)")
    return IdentityTokens(tokens, source=directory)


def server_tokens(config: ServerConfig) -> IdentityTokens | None:
    """The tokens a server checks: None in mTLS mode, else those of --tokens-dir."""
    if config.mtls:
        return None
    if config.tokens_dir is None:
        raise ValueError("token mode needs --tokens-dir (or --tls-cert/--tls-key/--tls-ca for mutual TLS)")
    return load_tokens_dir(config.tokens_dir)


def create_tokens(directory: pathlib.Path, identities: Iterable[str]) -> list[str]:
    """Writes a new random token file (mode 0600) for each identity that has none; returns those created."""
    names = list(dict.fromkeys(identities))
    for name in names:
        check_identity(name)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    created = []
    for name in names:
        if not (directory / name).exists():
            write_private_file(directory / name, secrets.token_urlsafe(32) + "\n")
            created.append(name)
    return created


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Adds the `kvpush tokens` arguments."""
    parser.add_argument("--dir", type=pathlib.Path, required=True, help="the tokens directory (the control plane's --tokens-dir)")
    parser.add_argument("identities", nargs="+", metavar="ID", help="'router', 'broker' or an engine id")


def run(args: argparse.Namespace) -> int:
    """Creates the missing token files; prints which identities got one (never a token)."""
    try:
        created = create_tokens(args.dir, args.identities)
    except (ValueError, OSError) as exc:
        print(f"kvpush tokens: {exc}", file=sys.stderr)
        return 2
    kept = [name for name in dict.fromkeys(args.identities) if name not in created]
    print(f"{args.dir}: created {', '.join(created) or 'none'}; kept {', '.join(kept) or 'none'}")
    return 0
