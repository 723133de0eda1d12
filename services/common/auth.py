# SPDX-License-Identifier: Apache-2.0
"""Who is calling, and what each identity may do.

Token mode: every call but health checks carries
`authorization: Bearer <token>`; TokenAuthInterceptor maps the token to its
identity (services/common/tokens.py). mTLS mode: the TLS handshake already
demanded a client certificate and its common name is the identity. Either
way the identity is `router`, `broker` or an engine id, and the servicers
ask the Authenticator:

* engine-scoped calls (registration, leases, reports, order and event
  streams) need the caller to be the engine they name; `router` and `broker`
  never act for an engine;
* CancelTransfer and GetTransfer come from the router or an engine (the
  core checks that an engine cancels only as itself); `broker` makes neither;
* engine reads (GetEngine, ListEngines, WatchEngines) are open to any
  authenticated identity.
"""

from __future__ import annotations

import contextvars
from collections.abc import Awaitable, Callable

import grpc

from kvpush import status
from kvpush.errors import KvpushError, PermissionDenied, Reason, Unauthenticated
from kvpush.services.common.tokens import BROKER_IDENTITY, ROUTER_IDENTITY, SERVICE_IDENTITIES, IdentityTokens
from kvpush.services.common.validation import ID_PATTERN

AUTHORIZATION_KEY = "authorization"
BEARER_PREFIX = "Bearer "
HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"

# The identity TokenAuthInterceptor authenticated. grpc.aio runs each call's
# interceptors and handler in one task of its own, so the value set for a
# call is what its handler reads, and no other call sees it.
_token_identity: contextvars.ContextVar[str] = contextvars.ContextVar("kvpush_token_identity", default="")


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
    """Refuses calls without a known identity's bearer token (health checks are exempt, for probes)."""

    def __init__(self, tokens: IdentityTokens):
        self._tokens = tokens

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]], handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        if handler_call_details.method.startswith(HEALTH_METHOD_PREFIX):
            return await continuation(handler_call_details)
        presented = metadata_value(handler_call_details.invocation_metadata, AUTHORIZATION_KEY)
        if presented is None:
            error: KvpushError = Unauthenticated("calls must carry 'authorization: Bearer <token>'", reason=Reason.MISSING_CREDENTIALS)
        else:
            identity = self._tokens.identify(presented[len(BEARER_PREFIX) :]) if presented.startswith(BEARER_PREFIX) else None
            if identity is not None:
                _token_identity.set(identity)
                return await continuation(handler_call_details)
            error = Unauthenticated("the bearer token is not valid", reason=Reason.BAD_TOKEN)
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
    """Decides who a call is from and whether that identity may make it, for servicers."""

    def __init__(self, *, mtls: bool):
        self.mtls = mtls

    def identity(self, context: grpc.aio.ServicerContext) -> str:
        """The caller: `router`, `broker` or an engine id (any authenticated identity)."""
        if self.mtls:
            return peer_common_name(context)
        identity = _token_identity.get()
        if not identity:  # only a server built without TokenAuthInterceptor gets here
            raise Unauthenticated("the call was not authenticated", reason=Reason.MISSING_CREDENTIALS)
        return identity

    def engine_identity(self, context: grpc.aio.ServicerContext, field: str) -> str:
        """The caller, which must be an engine: `router` and `broker` never act for one."""
        name = self.identity(context)
        if name in SERVICE_IDENTITIES:
            raise PermissionDenied(f"{name!r} may not act for an engine", reason=Reason.ENGINE_IDENTITY_MISMATCH, field=field)
        return name

    def engine_caller(self, context: grpc.aio.ServicerContext, engine_id: str, field: str) -> str:
        """The caller, proven to be engine_id.

        An engine_id that is not a valid id returns "" so the core reports
        the malformed field; every valid one must be the caller's.
        """
        return self.acting_for(self.engine_identity(context, field), engine_id, field)

    @staticmethod
    def acting_for(name: str, engine_id: str, field: str) -> str:
        """engine_caller for an identity already proven (an EngineReports stream's, once per stream)."""
        if ID_PATTERN.fullmatch(engine_id) is None:
            return ""
        if name != engine_id:
            raise PermissionDenied(f"{name!r} may not act for engine {engine_id!r}", reason=Reason.ENGINE_IDENTITY_MISMATCH, field=field)
        return name

    def transfer_caller(self, context: grpc.aio.ServicerContext) -> str | None:
        """The engine a transfer-level call (CancelTransfer, GetTransfer) comes from, or None for the router."""
        name = self.identity(context)
        if name == BROKER_IDENTITY:
            raise PermissionDenied("'broker' may only read engines", reason=Reason.ENGINE_IDENTITY_MISMATCH)
        return None if name == ROUTER_IDENTITY else name
