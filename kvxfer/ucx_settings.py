"""UCX settings kvxfer applies before UCX loads, and the environment that keeps UCX on loopback."""

from __future__ import annotations

import os

#: Settings that make UCX fast on loopback tcp and shared memory (docs/how-to/tuning.md), and let a
#: restarted daemon listen on its old port at once.
UCX_DEFAULTS = {
    "UCX_RNDV_SCHEME": "put_zcopy",
    "UCX_RNDV_THRESH": "32K",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    # A daemon restarted after a crash keeps its --ucx-port: without this, bind fails
    # ("Address already in use") while the dead process's connections are in TIME_WAIT.
    "UCX_TCP_CM_REUSEADDR": "y",
}

#: The environment of a daemon, test or benchmark whose data plane must stay on this machine.
LOOPBACK_ENV = {"UCX_NET_DEVICES": "lo"}


def apply_ucx_defaults() -> None:
    """Set kvxfer's UCX defaults unless the operator already set them. Call before UCX loads."""
    for key, value in UCX_DEFAULTS.items():
        os.environ.setdefault(key, value)
