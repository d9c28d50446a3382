"""The worker-side client library and the ``kvxfer`` command line."""

from kvxfer.client.library import AttachedPool, KvxferClient, TransferInfo

__all__ = ["AttachedPool", "KvxferClient", "TransferInfo"]
