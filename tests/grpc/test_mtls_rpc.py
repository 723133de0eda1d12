# SPDX-License-Identifier: Apache-2.0
"""Mutual TLS: the client certificate's common name is the caller (`router`, `broker` or an engine id); engines act only for themselves."""

from __future__ import annotations

import datetime
import ipaddress
import pathlib

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from rpc_harness import CALL_TIMEOUT_S, expect_rpc_error, running_control_plane

from kvpush.dev import sample_engines as sample
from kvpush.errors import Reason
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.registrar.v1 import registrar_service_pb2_grpc as reg_grpc
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import rendezvous_service_pb2_grpc as rv_grpc
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.services.common.config import ServerConfig

T = CALL_TIMEOUT_S
CODE = grpc.StatusCode
DENIED, MISMATCH = CODE.PERMISSION_DENIED, Reason.ENGINE_IDENTITY_MISMATCH


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _certificate(common_name: str, key, issuer_name: x509.Name, issuer_key, *, ca: bool = False, server: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]), critical=False
        )
    return builder.sign(issuer_key, hashes.SHA256())


class Pki:
    """A throwaway CA with a server certificate for 127.0.0.1 and client certificates by common name."""

    def __init__(self, directory: pathlib.Path):
        self.directory = directory
        self._ca_key = _key()
        self._ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvpush test CA")])
        self.ca_pem = _certificate("kvpush test CA", self._ca_key, self._ca_name, self._ca_key, ca=True).public_bytes(
            serialization.Encoding.PEM
        )
        (directory / "ca.pem").write_bytes(self.ca_pem)
        key_pem, cert_pem = self.issue("control-plane", server=True)
        (directory / "server.key").write_bytes(key_pem)
        (directory / "server.pem").write_bytes(cert_pem)

    def issue(self, common_name: str, *, server: bool = False) -> tuple[bytes, bytes]:
        key = _key()
        cert = _certificate(common_name, key, self._ca_name, self._ca_key, server=server)
        return _pem_key(key), cert.public_bytes(serialization.Encoding.PEM)

    def server_config(self) -> ServerConfig:
        d = self.directory
        return ServerConfig(listen="127.0.0.1:0", tls_cert=d / "server.pem", tls_key=d / "server.key", tls_ca=d / "ca.pem")

    def channel(self, port: int, common_name: str | None) -> grpc.aio.Channel:
        if common_name is None:
            credentials = grpc.ssl_channel_credentials(root_certificates=self.ca_pem)
        else:
            key_pem, cert_pem = self.issue(common_name)
            credentials = grpc.ssl_channel_credentials(root_certificates=self.ca_pem, private_key=key_pem, certificate_chain=cert_pem)
        return grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials)


@pytest.fixture
async def pki_plane(tmp_path):
    pki = Pki(tmp_path)
    async with running_control_plane(pki.server_config()) as plane:
        yield pki, plane


async def test_engines_act_only_for_the_engine_their_certificate_names(pki_plane):
    pki, plane = pki_plane
    async with pki.channel(plane.port, "prefill-0") as prefill_channel, pki.channel(plane.port, "decode-0") as decode_channel:
        prefill_registrar = reg_grpc.RegistrarServiceStub(prefill_channel)
        await prefill_registrar.RegisterEngineRank(sample.rank_request("prefill-0", sample.PREFILL), timeout=T)
        await reg_grpc.RegistrarServiceStub(decode_channel).RegisterEngineRank(sample.rank_request("decode-0", sample.DECODE), timeout=T)
        await expect_rpc_error(
            prefill_registrar.RegisterEngineRank(sample.rank_request("decode-1", sample.DECODE), timeout=T),
            CODE.PERMISSION_DENIED,
            Reason.ENGINE_IDENTITY_MISMATCH,
            "rank.engine_id",
        )
        decode_broker = rv_grpc.RendezvousServiceStub(decode_channel)
        response = await decode_broker.RegisterDestination(sample.destination_request("t1"), timeout=T)  # no token needed
        assert response.state == tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL
        await expect_rpc_error(
            rv_grpc.RendezvousServiceStub(prefill_channel).RegisterDestination(sample.destination_request("t2"), timeout=T),
            CODE.PERMISSION_DENIED,
            Reason.ENGINE_IDENTITY_MISMATCH,
            "destination.engine_id",
        )


async def test_router_may_query_and_cancel_but_a_stranger_may_not_cancel(pki_plane):
    pki, plane = pki_plane
    async with pki.channel(plane.port, "decode-0") as decode_channel, pki.channel(plane.port, "prefill-0") as prefill_channel:
        await reg_grpc.RegistrarServiceStub(prefill_channel).RegisterEngineRank(sample.rank_request("prefill-0", sample.PREFILL), timeout=T)
        await reg_grpc.RegistrarServiceStub(decode_channel).RegisterEngineRank(sample.rank_request("decode-0", sample.DECODE), timeout=T)
        await rv_grpc.RendezvousServiceStub(decode_channel).RegisterDestination(sample.destination_request("t1"), timeout=T)
    cancel = rv_pb.CancelTransferRequest(key=tr_pb.TransferKey(transfer_id="t1", attempt=1))
    async with pki.channel(plane.port, "mallory") as stranger:
        # No registered engine goes by this identity (yet, as far as the broker knows): it may retry, and cancels nothing.
        await expect_rpc_error(rv_grpc.RendezvousServiceStub(stranger).CancelTransfer(cancel, timeout=T), CODE.UNAVAILABLE,
                               Reason.ENGINE_NOT_FOUND)
    async with pki.channel(plane.port, "router") as router_channel:
        router = rv_grpc.RendezvousServiceStub(router_channel)
        assert (await router.CancelTransfer(cancel, timeout=T)).state == tr_pb.TRANSFER_STATE_CANCELLED
        transfer = (await router.GetTransfer(rv_pb.GetTransferRequest(transfer_id="t1"), timeout=T)).transfer
        assert transfer.end_reason == tr_pb.END_REASON_CANCELLED_BY_ROUTER


async def test_a_client_without_a_certificate_is_refused(pki_plane):
    pki, plane = pki_plane
    async with pki.channel(plane.port, None) as anonymous:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await rv_grpc.RendezvousServiceStub(anonymous).GetTransfer(rv_pb.GetTransferRequest(transfer_id="t1"), timeout=T)
        assert info.value.code() == CODE.UNAVAILABLE  # the TLS handshake itself fails


async def test_router_and_broker_certificates_never_act_for_an_engine(pki_plane):
    pki, plane = pki_plane
    async with pki.channel(plane.port, "prefill-0") as prefill_channel:
        await reg_grpc.RegistrarServiceStub(prefill_channel).RegisterEngineRank(sample.rank_request("prefill-0", sample.PREFILL), timeout=T)
    for identity in ("router", "broker"):
        async with pki.channel(plane.port, identity) as channel:
            registrar, broker = reg_grpc.RegistrarServiceStub(channel), rv_grpc.RendezvousServiceStub(channel)
            await expect_rpc_error(
                registrar.RegisterEngineRank(sample.rank_request("prefill-0", sample.PREFILL), timeout=T),
                DENIED,
                MISMATCH,
                "rank.engine_id",
            )
            await expect_rpc_error(registrar.KeepAlive(timeout=T).read(), DENIED, MISMATCH, "lease_ids")
            await expect_rpc_error(
                broker.ReportPrefillDone(sample.prefill_done_request("t1"), timeout=T), DENIED, MISMATCH, "source.engine_id"
            )
            await expect_rpc_error(
                broker.RegisterDestination(sample.destination_request("t1"), timeout=T), DENIED, MISMATCH, "destination.engine_id"
            )
            await expect_rpc_error(broker.ReportWriteResult(sample.write_result_request("t1"), timeout=T), DENIED, MISMATCH, "engine_id")
            orders = broker.StreamWriteOrders(rv_pb.StreamWriteOrdersRequest(engine_id="prefill-0", incarnation="inc-1"), timeout=T)
            await expect_rpc_error(orders.read(), DENIED, MISMATCH, "engine_id")
            events = broker.StreamTransferEvents(rv_pb.StreamTransferEventsRequest(engine_id="decode-0", incarnation="inc-1"), timeout=T)
            await expect_rpc_error(events.read(), DENIED, MISMATCH, "engine_id")


async def test_an_engine_certificate_may_not_take_over_another_engines_ranks(pki_plane):
    pki, plane = pki_plane
    async with pki.channel(plane.port, "prefill-0") as prefill_channel, pki.channel(plane.port, "decode-0") as decode_channel:
        prefill_registrar = reg_grpc.RegistrarServiceStub(prefill_channel)
        lease = await reg_grpc.RegistrarServiceStub(decode_channel).RegisterEngineRank(
            sample.rank_request("decode-0", sample.DECODE), timeout=T
        )
        for incarnation in ("inc-1", "inc-2"):  # the identical rank (its lease), then a new incarnation (eviction)
            call = prefill_registrar.RegisterEngineRank(sample.rank_request("decode-0", sample.DECODE, incarnation=incarnation), timeout=T)
            await expect_rpc_error(call, DENIED, MISMATCH, "rank.engine_id")
        keep_alive = prefill_registrar.KeepAlive(timeout=T)
        await keep_alive.write(reg_pb.KeepAliveRequest(lease_ids=[lease.lease_id]))
        await expect_rpc_error(keep_alive.read(), DENIED, MISMATCH, "lease_ids")
        await expect_rpc_error(
            prefill_registrar.DeregisterEngineRank(reg_pb.DeregisterEngineRankRequest(lease_id=lease.lease_id), timeout=T),
            DENIED,
            MISMATCH,
            "lease_id",
        )
        await expect_rpc_error(
            rv_grpc.RendezvousServiceStub(prefill_channel)
            .StreamTransferEvents(rv_pb.StreamTransferEventsRequest(engine_id="decode-0", incarnation="inc-1"), timeout=T)
            .read(),
            DENIED,
            MISMATCH,
            "engine_id",
        )
    assert plane.registrar.get_engine("decode-0").incarnation == "inc-1" and plane.registrar.lease_engine(lease.lease_id) == "decode-0"


async def test_the_broker_certificate_reads_engines_and_nothing_else(pki_plane):
    pki, plane = pki_plane
    async with pki.channel(plane.port, "decode-0") as decode_channel, pki.channel(plane.port, "prefill-0") as prefill_channel:
        await reg_grpc.RegistrarServiceStub(prefill_channel).RegisterEngineRank(sample.rank_request("prefill-0", sample.PREFILL), timeout=T)
        await reg_grpc.RegistrarServiceStub(decode_channel).RegisterEngineRank(sample.rank_request("decode-0", sample.DECODE), timeout=T)
        await rv_grpc.RendezvousServiceStub(decode_channel).RegisterDestination(sample.destination_request("t1"), timeout=T)
    async with pki.channel(plane.port, "broker") as broker_channel:
        listing = await reg_grpc.RegistrarServiceStub(broker_channel).ListEngines(reg_pb.ListEnginesRequest(), timeout=T)
        assert [engine.engine_id for engine in listing.engines] == ["decode-0", "prefill-0"]
        broker = rv_grpc.RendezvousServiceStub(broker_channel)
        cancel = rv_pb.CancelTransferRequest(key=tr_pb.TransferKey(transfer_id="t1", attempt=1))
        await expect_rpc_error(broker.CancelTransfer(cancel, timeout=T), DENIED, MISMATCH)
        await expect_rpc_error(broker.GetTransfer(rv_pb.GetTransferRequest(transfer_id="t1"), timeout=T), DENIED, MISMATCH)
