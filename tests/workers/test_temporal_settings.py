"""Temporal's connection settings, taken as the temporal CLI takes them (workers/temporal.py): a table
of flags and environments against the Client.connect settings they make, then real connections to a
dev server, plain and (the dev server serves no TLS) through a proxy that requires mutual TLS."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from temporalio.envconfig import ClientConnectConfig
from temporalio.service import TLSConfig

from stayalive.agent.relay import splice
from stayalive.core.run.launch import Endpoint
from stayalive.workers.devstack import DevStack, free_port
from stayalive.workers.temporal import add_temporal_flags, client_config, connect

DEFAULT: dict[str, object] = {"target_host": "127.0.0.1:7233", "namespace": "default"}


def settings(
    flags: list[str], env: dict[str, str] | None = None, address: str = "127.0.0.1:7233"
) -> ClientConnectConfig:
    parser = argparse.ArgumentParser()
    add_temporal_flags(parser)
    return client_config(parser.parse_args(flags), env=env or {}, default_address=address)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for localhost and a client certificate it signed (openssl, EC P-256)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("pki")
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    openssl("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=test-ca")
    for name, extensions in (
        ("server", "subjectAltName=DNS:localhost\nextendedKeyUsage=serverAuth\n"),
        ("client", "extendedKeyUsage=clientAuth\n"),
    ):
        (d / f"{name}.ext").write_text(extensions)
        openssl("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        signed = ["-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days", "1", "-extfile", f"{name}.ext"]
        openssl("x509", "-req", "-in", f"{name}.csr", *signed, "-out", f"{name}.pem")
    return d


def test_flags_and_environment_make_the_settings_the_temporal_cli_would(pki: Path) -> None:
    ca, cert, key = (pki / "ca.pem").read_bytes(), (pki / "client.pem").read_bytes(), (pki / "client.key").read_bytes()
    mtls = TLSConfig(server_root_ca_cert=ca, client_cert=cert, client_private_key=key, domain="localhost")
    files = ["--tls-ca-path", str(pki / "ca.pem"), "--tls-cert-path", str(pki / "client.pem")]
    files += ["--tls-key-path", str(pki / "client.key"), "--tls-server-name", "localhost"]
    env_files = {
        "TEMPORAL_TLS_SERVER_CA_CERT_PATH": str(pki / "ca.pem"),
        "TEMPORAL_TLS_CLIENT_CERT_PATH": str(pki / "client.pem"),
        "TEMPORAL_TLS_CLIENT_KEY_PATH": str(pki / "client.key"),
        "TEMPORAL_TLS_SERVER_NAME": "localhost",
    }
    table: list[tuple[list[str], dict[str, str], dict[str, object]]] = [
        ([], {}, DEFAULT),
        (
            [],
            {"TEMPORAL_ADDRESS": "t.example:7233", "TEMPORAL_NAMESPACE": "ml"},
            {"target_host": "t.example:7233", "namespace": "ml"},
        ),
        (
            ["--address", "flag:1", "--namespace", "f"],
            {"TEMPORAL_ADDRESS": "env:2"},
            {"target_host": "flag:1", "namespace": "f"},
        ),
        (["--tls"], {}, DEFAULT | {"tls": TLSConfig()}),
        ([], {"TEMPORAL_TLS": "true"}, DEFAULT | {"tls": TLSConfig()}),
        (["--no-tls"], {"TEMPORAL_TLS": "true"}, DEFAULT | {"tls": False}),
        (files, {}, DEFAULT | {"tls": mtls}),
        ([], env_files, DEFAULT | {"tls": mtls}),  # any TLS setting turns TLS on
        (["--tls-server-name", "other"], env_files, DEFAULT | {"tls": TLSConfig(**{**vars(mtls), "domain": "other"})}),
        (["--tls-ca-path", str(pki / "ca.pem")], {}, DEFAULT | {"tls": TLSConfig(server_root_ca_cert=ca)}),
        (["--api-key", "k"], {}, DEFAULT | {"api_key": "k", "tls": True}),
        ([], {"TEMPORAL_API_KEY": "k"}, DEFAULT | {"api_key": "k", "tls": True}),
        (["--api-key", "k", "--no-tls"], {}, DEFAULT | {"api_key": "k", "tls": False}),
    ]
    for flags, env, expected in table:
        assert settings(flags, env) == expected, (flags, env)
    assert settings([], {}, address="127.0.0.1:9999")["target_host"] == "127.0.0.1:9999"


def test_half_a_client_certificate_or_a_missing_file_is_refused(pki: Path) -> None:
    with pytest.raises(ValueError, match="--tls-cert-path with --tls-key-path"):
        settings(["--tls-cert-path", str(pki / "client.pem")])
    with pytest.raises(ValueError, match="cannot read"):
        settings(["--tls-ca-path", str(pki / "nowhere.pem")])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    dev = DevStack(state_dir=tmp_path_factory.mktemp("temporal"), nodes=[], port=free_port(), ui_port=None)
    dev.start_temporal()
    yield dev.address
    dev.stop()


@pytest.fixture
async def mtls_proxy(pki: Path, server: str) -> AsyncIterator[str]:
    """TLS in front of the plain dev server, as a TLS-terminating load balancer would be: it asks for a
    client certificate signed by the CA and hangs up on a caller without one."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=pki / "ca.pem")
    context.load_cert_chain(pki / "server.pem", pki / "server.key")
    context.verify_mode = ssl.CERT_REQUIRED
    context.set_alpn_protocols(["h2"])  # gRPC
    upstream = Endpoint.parse(server)

    async def carry(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await splice((reader, writer), await asyncio.open_connection(upstream.host, upstream.port))

    proxy = await asyncio.start_server(carry, "127.0.0.1", 0, ssl=context)
    yield f"127.0.0.1:{proxy.sockets[0].getsockname()[1]}"
    proxy.close()


async def test_a_plain_connection_to_the_dev_server(server: str) -> None:
    client = await connect(settings([], {"TEMPORAL_ADDRESS": server}))
    assert (await client.count_workflows()).count >= 0


async def test_mutual_tls_from_the_flags_and_no_connection_without_a_client_certificate(
    pki: Path, mtls_proxy: str
) -> None:
    ca = ["--address", mtls_proxy, "--tls-ca-path", str(pki / "ca.pem"), "--tls-server-name", "localhost"]
    certificate = ["--tls-cert-path", str(pki / "client.pem"), "--tls-key-path", str(pki / "client.key")]
    client = await connect(settings([*ca, *certificate]))
    assert (await client.count_workflows()).count >= 0  # a call carried over mutual TLS
    with pytest.raises(RuntimeError, match="Failed client connect"):
        await connect(settings(ca))  # no client certificate: the proxy hangs up
    with pytest.raises(RuntimeError, match="UnknownIssuer"):
        await connect(settings(["--address", mtls_proxy, "--tls", *certificate]))  # the server's CA is not trusted
