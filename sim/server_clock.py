"""The time-skipping test server's clock, as the simulated cluster reads it.

Under `WorkflowEnvironment.start_time_skipping`, the server's clock jumps to the next timer whenever
nothing is outstanding, so the simulated cluster's clock must be the server's, not this machine's:
every simulated activity reads it as it starts (the test service's GetCurrentTime) and nothing
simulated waits on real time. Local activities report this machine's time as their start, hence
the read.
"""

from __future__ import annotations

import time

from google.protobuf.empty_pb2 import Empty
from temporalio.client import Client


class ServerClock:
    def __init__(self, client: Client) -> None:
        self.client = client
        self.now = time.time()

    async def read(self) -> float:
        """The server's time now (it never runs backwards)."""
        answer = await self.client.test_service.get_current_time(Empty())
        self.now = max(self.now, answer.time.ToMicroseconds() / 1e6)
        return self.now

    def __call__(self) -> float:
        """The server's time as last read."""
        return self.now
