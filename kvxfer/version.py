"""The version of kvxfer's distributions (kvxfer, kvxfer-client, kvxfer-server: released together).

``kvxfer`` is a namespace package: ``kvxfer/`` (the core: layouts, descriptors, pages,
memory, transport), ``server/kvxfer/server`` and ``client/kvxfer/client`` are each
their own distribution, installed per role (docs/how-to/install.md).
"""

from importlib.metadata import version

__version__ = version("kvxfer")
