"""A KV agent probed by bad connections (a port scan, a client of another protocol) logs the
first at once and the rest as one count per interval: the issue's 316 probes were 316
WARNING lines (issue 49, finding 6)."""

from __future__ import annotations

import asyncio
import logging

from disagg_fake_store import FakeStore

from kvpilot.engine.contracts.fleet_secret import FleetSecret
from kvpilot.engine.contracts.kv_client import request_stats
from kvpilot.engine.contracts.repeated_warnings import RepeatedWarnings
from kvpilot.engine.kv_transfer import tcp
from kvpilot.engine.kv_transfer.tcp import TcpConnector

SECRET = FleetSecret(bytes(range(32)))
PROBES = [b"XXXX" + bytes(9), b"GET / HTTP/1.1\r\n\r\n", b"", b"KVP"] * 8  # 32 connections


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


async def probe(port: int, raw: bytes) -> None:
    """Sends `raw` and waits until the agent hangs up (it has logged by then)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    writer.write_eof()  # a partial frame ends here, not at the handshake's timeout
    await asyncio.wait_for(reader.read(), 30)
    writer.close()


async def test_bad_connections_are_one_line_then_a_count(caplog):
    agent = TcpConnector(FakeStore(), "127.0.0.1", 0, kv_key=SECRET.kv_key)
    clock = Clock()
    agent._bad_connections = RepeatedWarnings(tcp.log, "bad KV agent connections",
                                              interval=60, clock=clock)
    agent.start()
    try:
        with caplog.at_level(logging.WARNING, logger=tcp.log.name):
            for raw in PROBES:
                await probe(agent.port, raw)

            def logged() -> list[str]:
                return [r.getMessage() for r in caplog.records if r.name == tcp.log.name]
            assert len(logged()) == 1 and "KV agent connection from" in logged()[0], logged()
            clock.now += 60  # the agent's tick (every 0.5 s) then logs the count
            for _ in range(600):
                if len(logged()) > 1:
                    break
                await asyncio.sleep(0.05)
            assert logged()[1:] == [
                f"{len(PROBES) - 1} more bad KV agent connections from 127.0.0.1 in the last "
                "60 s"]
        # and the agent still serves its own fleet
        assert (await request_stats(("127.0.0.1", agent.port), key=SECRET.kv_key))["leases"] == 0
    finally:
        agent.stop()
