"""The data plane: tagged messages between daemons over UCX.

- ``protocol``: ``Transport``, ``Batch`` and ``Connection``, what the state machine uses;
- ``engine``: ``UcxEngine``, one UCX worker driven by one thread;
- ``batches``: one transfer's sends or receives as the engine tracks them;
- ``owners``: the endpoints receives are posted through, so that they can be cancelled;
- ``lanes``: ``UcxLanes``, several engines side by side (the daemon's ``Transport``).

UCX's settings (``kvxfer.ucx_settings``) live outside this package: what imports them
needs no UCX.
"""

from kvxfer.transport.engine import UcxEngine
from kvxfer.transport.lanes import LaneConnection, UcxLanes
from kvxfer.transport.protocol import Batch, Connection, Message, Transport

__all__ = ["Batch", "Connection", "LaneConnection", "Message", "Transport", "UcxEngine", "UcxLanes"]
