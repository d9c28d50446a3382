"""The worker side of kvxfer, as the package ``kvxfer.client``.

- ``library``: ``KvxferClient`` (a daemon's worker API) and ``AttachedPool`` (its memory, mapped);
- ``handoff``: one transfer between a prefill and a decode daemon, driven from one place;
- ``spawn``: local daemons as subprocesses (the demo, ``bench --spawn``, tests);
- ``cli``, ``bench``, ``demo``: the ``kvxfer`` command line.
"""

from kvxfer.client.handoff import Handoff, hand_off
from kvxfer.client.library import AttachedPool, KvxferClient
from kvxfer.status import OfferHold, TransferInfo

__all__ = ["AttachedPool", "Handoff", "KvxferClient", "OfferHold", "TransferInfo", "hand_off"]
