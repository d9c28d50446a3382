"""A worker's call to a daemon that restarted waits (bounded) for it to be reachable again."""

from __future__ import annotations

import time

import pytest

from kvxfer.client import KvxferClient
from kvxfer.client.engine_core import reconnecting
from kvxfer.client.engine_core.reconnecting import Reconnecting
from kvxfer.errors import PeerUnavailableError

POOL = "name=kv,preset=tiny"


def backed_off(client: KvxferClient) -> None:
    """Call the dead daemon until its channel backs off the longest (gRPC's backoff grows
    1.6x per failed connection, to the client's 1 s cap)."""
    for _ in range(12):
        with pytest.raises(PeerUnavailableError):
            client.health()
        time.sleep(0.15)


def test_a_call_reaches_a_restarted_daemon_and_a_dead_one_fails_at_once(spawn, monkeypatch) -> None:
    daemon = spawn("restarting", [POOL])
    with KvxferClient(daemon.worker_address, timeout_s=5) as client:
        reach = Reconnecting(client)
        assert reach.call(client.health) == "SERVING"
        daemon.kill()
        backed_off(client)
        daemon.restart()
        start = time.monotonic()
        assert reach.call(client.health) == "SERVING"
        assert time.monotonic() - start < reconnecting.RECONNECT_WAIT_S + 1
        daemon.kill()
        monkeypatch.setattr(reconnecting, "RECONNECT_WAIT_S", 0.3)
        with pytest.raises(PeerUnavailableError):
            reach.call(client.health)  # waits 0.3 s in vain: down for DOWN_S
        start = time.monotonic()
        with pytest.raises(PeerUnavailableError):
            reach.call(client.health)
        assert time.monotonic() - start < 0.2  # no second wait while it is down
