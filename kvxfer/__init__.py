"""kvxfer: move page-major KV caches between prefill and decode daemons.

The core library (this package) holds the layout math, descriptors, page-range
algebra, shared memory and the UCX transport; it has no gRPC server code.
``kvxfer.server`` (the ``server/`` folder) is the daemon and ``kvxfer.client``
(``client/``) the worker library and CLI.
"""

__version__ = "0.1.0"
