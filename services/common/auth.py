# SPDX-License-Identifier: Apache-2.0
"""Who may call: the shared-token interceptor, engine binding, and mTLS identities.

Shared-token mode: every call but health checks carries
`authorization: Bearer <token>` (checked by TokenAuthInterceptor); calls made
for an engine also carry `kvpush-engine-token`, which must be the token the
registrar minted for that engine. mTLS mode: the TLS handshake already
demanded a client certificate; its common name is the caller, engine-scoped
calls need it to equal the engine id, and "router" may cancel and query.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

import grpc

from kvpush import status
from kvpush.errors import KvpushError, PermissionDenied, Reason, Unauthenticated
from kvpush.services.common.engine_tokens import claimed_engine
from kvpush.services.common.validation import ID_PATTERN

AUTHORIZATION_KEY = "authorization"
ENGINE_TOKEN_KEY = "kvpush-engine-token"
ROUTER_IDENTITY = "router"
HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"

# check_engine_token(engine_id, token) -> bool
EngineTokenCheck = Callable[[str, str], bool]


def metadata_value(metadata, key: str) -> str | None:
    """The first value of key in gRPC invocation metadata, or None."""
    for item_key, value in metadata or ():
        if item_key == key:
            return value if isinstance(value, str) else value.decode("ascii", "replace")
    return None


def _refusal_handler(handler: grpc.RpcMethodHandler, error: KvpushError) -> grpc.RpcMethodHandler:
    """A handler of the same shape as handler that only aborts with error."""
    rich_status = status.to_status(error)

    async def refuse(_request, context: grpc.aio.ServicerContext) -> None:
        await context.abort_with_status(rich_status)

    if handler.request_streaming and handler.response_streaming:
        make = grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        make = grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        make = grpc.unary_stream_rpc_method_handler
    else:
        make = grpc.unary_unary_rpc_method_handler
    return make(refuse, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without the shared bearer token (health checks are exempt, for probes)."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("the shared token must not be empty")
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(HEALTH_METHOD_PREFIX):
            return await continuation(handler_call_details)
        presented = metadata_value(handler_call_details.invocation_metadata, AUTHORIZATION_KEY)
        if presented is None:
            error: KvpushError = Unauthenticated("calls must carry 'authorization: Bearer <token>'", reason=Reason.MISSING_CREDENTIALS)
        elif not hmac.compare_digest(presented.encode(), self._expected):
            error = Unauthenticated("the bearer token is not valid", reason=Reason.BAD_TOKEN)
        else:
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        return None if handler is None else _refusal_handler(handler, error)


def peer_common_name(context: grpc.aio.ServicerContext) -> str:
    """The client certificate's common name (mTLS)."""
    names = context.auth_context().get("x509_common_name") or []
    if not names:
        raise Unauthenticated("a client certificate with a common name is required", reason=Reason.MISSING_CREDENTIALS)
    name = names[0]
    return name.decode() if isinstance(name, bytes) else name


class Authenticator:
    """Decides who a call is from, for servicers (the bearer token is already checked)."""

    def __init__(self, *, mtls: bool, check_engine_token: EngineTokenCheck):
        self.mtls = mtls
        self._check_engine_token = check_engine_token

    def engine_caller(self, context: grpc.aio.ServicerContext, engine_id: str, field: str) -> str:
        """The caller, proven to act for engine_id.

        An engine_id that is not a valid id returns "" so the core reports
        the malformed field; every valid one is bound.
        """
        if ID_PATTERN.fullmatch(engine_id) is None:
            return ""
        if self.mtls:
            name = peer_common_name(context)
            if name != engine_id:
                raise PermissionDenied(f"certificate {name!r} may not act for engine {engine_id!r}", reason=Reason.ENGINE_IDENTITY_MISMATCH, field=field)
            return name
        token = metadata_value(context.invocation_metadata(), ENGINE_TOKEN_KEY)
        if not token:
            raise Unauthenticated(f"calls for an engine must carry {ENGINE_TOKEN_KEY!r}", reason=Reason.MISSING_CREDENTIALS, field=field)
        if not self._check_engine_token(engine_id, token):
            raise PermissionDenied(f"the engine token does not belong to engine {engine_id!r}", reason=Reason.ENGINE_IDENTITY_MISMATCH, field=field)
        return engine_id

    def registering_caller(self, context: grpc.aio.ServicerContext, engine_id: str, field: str) -> None:
        """Registration: in mTLS mode the certificate must name the engine; a shared-token caller needs no engine token yet."""
        if self.mtls and ID_PATTERN.fullmatch(engine_id) is not None:
            self.engine_caller(context, engine_id, field)

    def caller_engine(self, context: grpc.aio.ServicerContext) -> str | None:
        """The engine a router-level call comes from, or None when it comes from the router (or an operator)."""
        if self.mtls:
            name = peer_common_name(context)
            return None if name == ROUTER_IDENTITY else name
        token = metadata_value(context.invocation_metadata(), ENGINE_TOKEN_KEY)
        if not token:
            return None
        engine_id = claimed_engine(token)
        if not engine_id or not self._check_engine_token(engine_id, token):
            raise PermissionDenied("the engine token is not valid for any registered engine", reason=Reason.ENGINE_IDENTITY_MISMATCH)
        return engine_id
