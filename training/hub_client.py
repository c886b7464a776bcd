"""A rank's connection to a node agent's hub: it answers the hub's challenge with its run's token
(STAYALIVE_RUN_TOKEN, core.protocol.access), then says why it calls."""

from __future__ import annotations

import socket
from typing import BinaryIO

from pydantic import BaseModel, ValidationError

from stayalive.core.protocol.access import knock


def connect_hub(address: str, opening: BaseModel, token: str, timeout: float) -> tuple[socket.socket, BinaryIO]:
    """The socket, and the reader to go on reading its answers with (it may hold bytes read ahead)."""
    host, port = address.rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=timeout)
    reader = conn.makefile("rb")
    try:
        conn.sendall(knock(reader.readline(), token.encode(), opening))
    except ValidationError:
        conn.close()
        raise ConnectionError(f"what answered at {address} is not a node agent's hub") from None
    except BaseException:
        conn.close()
        raise
    return conn, reader
