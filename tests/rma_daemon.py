"""``kvxfer serve`` whose UCX contexts also have the RMA feature: the negative control of
test_ucx_port.py (the production daemon creates TAG and WAKEUP contexts only).

usage: python tests/rma_daemon.py SERVE-ARGS...
"""

from __future__ import annotations

import sys
from typing import Any

from ucxx._lib import libucxx

from kvxfer.client.cli import main

_context = libucxx.UCXContext


def with_rma(*args: Any, feature_flags: tuple[Any, ...] = (), **kwargs: Any) -> Any:
    return _context(*args, feature_flags=(*feature_flags, libucxx.Feature.RMA), **kwargs)


if __name__ == "__main__":
    libucxx.UCXContext = with_rma
    sys.exit(main())
