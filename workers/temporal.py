"""Where the workers and the `stayalive` CLI find Temporal and how they prove themselves to it: the
temporal CLI's connection flags and environment variables, with its names and precedence (a flag,
else the environment, else the default), so one set of settings serves `temporal` and `stayalive`.

    --address HOST:PORT       TEMPORAL_ADDRESS
    --namespace NAME          TEMPORAL_NAMESPACE
    --api-key KEY             TEMPORAL_API_KEY
    --tls / --no-tls          TEMPORAL_TLS
    --tls-cert-path FILE      TEMPORAL_TLS_CLIENT_CERT_PATH      client certificate (mutual TLS)
    --tls-key-path FILE       TEMPORAL_TLS_CLIENT_KEY_PATH       its private key
    --tls-ca-path FILE        TEMPORAL_TLS_SERVER_CA_CERT_PATH   the CA that signed the server's certificate
    --tls-server-name NAME    TEMPORAL_TLS_SERVER_NAME           the name that certificate must carry

An API key or any TLS setting turns TLS on, as it does for the temporal CLI. The environment is read
by temporalio's envconfig, which is where the CLI's own settings come from (the *_DATA variants work
too); unlike the CLI, no config file or profile is read.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.envconfig import ClientConfigProfile, ClientConfigTLS, ClientConnectConfig

DEFAULT_ADDRESS = "127.0.0.1:7233"


def add_temporal_flags(parser: argparse.ArgumentParser, address_help: str = "Temporal frontend host:port") -> None:
    parser.add_argument("--address", default=None, help=f"{address_help} ($TEMPORAL_ADDRESS)")
    parser.add_argument("--namespace", default=None, help="Temporal namespace ($TEMPORAL_NAMESPACE; default: default)")
    parser.add_argument("--api-key", default=None, help="API key; turns TLS on ($TEMPORAL_API_KEY)")
    parser.add_argument(
        "--tls", action=argparse.BooleanOptionalAction, default=None, help="TLS to the server ($TEMPORAL_TLS)"
    )
    parser.add_argument("--tls-cert-path", default=None, help="client certificate for mutual TLS")
    parser.add_argument("--tls-key-path", default=None, help="the client certificate's private key")
    parser.add_argument("--tls-ca-path", default=None, help="CA certificate the server's certificate is checked with")
    parser.add_argument("--tls-server-name", default=None, help="server name its certificate is checked for")


def client_config(
    args: argparse.Namespace, env: Mapping[str, str] | None = None, default_address: str = DEFAULT_ADDRESS
) -> ClientConnectConfig:
    """Client.connect's settings from the flags in `args`, else from `env` (the process's environment)."""
    profile = ClientConfigProfile.load(disable_file=True, override_env_vars=dict(os.environ if env is None else env))
    tls = profile.tls or ClientConfigTLS()
    files = {
        "client_cert": args.tls_cert_path,
        "client_private_key": args.tls_key_path,
        "server_root_ca_cert": args.tls_ca_path,
    }
    tls = dataclasses.replace(
        tls,
        **{field: Path(path) for field, path in files.items() if path},
        server_name=args.tls_server_name or tls.server_name,
        disabled=tls.disabled if args.tls is None else not args.tls,
    )
    if (tls.client_cert is None) != (tls.client_private_key is None):
        raise ValueError("mutual TLS takes a client certificate and its key: --tls-cert-path with --tls-key-path")
    chosen = dataclasses.replace(
        profile,
        address=args.address or profile.address or default_address,
        namespace=args.namespace or profile.namespace or "default",
        api_key=args.api_key or profile.api_key,
        tls=None if tls == ClientConfigTLS() else tls,  # nothing said about TLS: plain, unless an API key
    )
    try:
        return chosen.to_client_connect_config()  # reads the certificate files
    except OSError as exc:
        raise ValueError(f"cannot read {exc.filename}: {exc.strerror}") from None


def plain(address: str, namespace: str = "default") -> ClientConnectConfig:
    """A server without TLS, such as the dev stack's own."""
    return ClientConnectConfig(target_host=address, namespace=namespace)


async def connect(config: ClientConnectConfig) -> Client:
    return await Client.connect(**config, data_converter=pydantic_data_converter)
