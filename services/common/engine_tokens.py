# SPDX-License-Identifier: Apache-2.0
"""Engine tokens: the secret that binds calls to the engine that registered.

A token is `<engine_id>/<HMAC-SHA256(key, engine_id, incarnation)>` under a
key only the control-plane services hold. Deriving it (rather than storing a
random one) lets a broker running apart from the registrar check tokens with
nothing but the key and the engine's incarnation from its directory mirror;
a new incarnation gets a new token, so a restarted engine's predecessor
cannot act for it. The engine id prefix names the claimed engine, so calls
that name no engine (CancelTransfer) still learn who is calling.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

KEY_BYTES = 32
# Minted tokens are memoized (checking is on every engine call); the memo
# starts over beyond this many engine incarnations.
_MEMO_LIMIT = 4096


def generate_key() -> bytes:
    """A fresh random key."""
    return secrets.token_bytes(KEY_BYTES)


class EngineTokens:
    """Mints and checks engine tokens under one key."""

    __slots__ = ("_key", "_minted")

    def __init__(self, key: bytes):
        if len(key) < 16:
            raise ValueError("the engine token key needs at least 16 bytes")
        self._key = key
        self._minted: dict[tuple[str, str], bytes] = {}

    def mint(self, engine_id: str, incarnation: str) -> str:
        return self._token(engine_id, incarnation).decode()

    def check(self, engine_id: str, incarnation: str, token: str) -> bool:
        """True when token is the one minted for this engine incarnation (constant time)."""
        return hmac.compare_digest(token.encode(), self._token(engine_id, incarnation))

    def _token(self, engine_id: str, incarnation: str) -> bytes:
        token = self._minted.get((engine_id, incarnation))
        if token is None:
            mac = hmac.new(self._key, f"{engine_id}\n{incarnation}".encode(), hashlib.sha256).digest()
            token = f"{engine_id}/{base64.urlsafe_b64encode(mac).rstrip(b'=').decode()}".encode()
            if len(self._minted) >= _MEMO_LIMIT:
                self._minted.clear()
            self._minted[(engine_id, incarnation)] = token
        return token


def claimed_engine(token: str) -> str:
    """The engine id a token claims to belong to ("" for a malformed token)."""
    engine_id, sep, _ = token.rpartition("/")
    return engine_id if sep else ""
