"""One NIXL agent for ``vs_nixl.py``, run with ``.venv-nixl`` (``scripts/setup-nixl.sh``).

    python benchmarks/nixl_peer.py {initiator,target} --bytes N [--memory shm|anon] [--eh on|off]

It registers ``--bytes`` of host memory with NIXL's UCX backend (a /dev/shm file like
kvxfer's pools, or anonymous memory, NIXL's usual case), prints one JSON line with its
agent metadata, then answers JSON commands on stdin, one line each:

    {"op": "peer", "metadata": B64, "addr": A}    learn the other agent (and its buffer address)
    {"op": "write", "id": ID, "segments": [[src_offset, dst_offset, nbytes], ...]}
        (initiator) one WRITE of the segments, with notification ID; answers {"sent": ID}
    {"op": "await", "id": ID}   (target) wait for the notification ID; answers {"done": ID}
    {"op": "fill", "seed": S}   write seeded bytes over the whole buffer; answers {"filled": S}
    {"op": "digest", "segments": [[offset, nbytes], ...]}   answers {"digest": HEX}
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import mmap
import os
import sys
import tempfile
import time

import numpy as np
from nixl_cu12._api import nixl_agent, nixl_agent_config

POLL_S = 0.0001


def _buffer(size: int, memory: str) -> tuple[mmap.mmap, np.ndarray]:
    if memory == "anon":
        mapping = mmap.mmap(-1, size)
    else:
        fd, path = tempfile.mkstemp(prefix="nixl-bench-", dir="/dev/shm")
        os.unlink(path)
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size)
        os.close(fd)
    array = np.frombuffer(mapping, dtype=np.uint8)
    array[::4096] = 0  # fault every page in, as kvxfer pre-faults its pools
    return mapping, array


def _say(message: dict[str, object]) -> None:
    print(json.dumps(message), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=("initiator", "target"))
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--memory", choices=("shm", "anon"), default="shm")
    parser.add_argument("--eh", choices=("on", "off"), default="on")
    args = parser.parse_args()

    _mapping, array = _buffer(args.bytes, args.memory)
    base = int(array.ctypes.data)
    agent = nixl_agent(args.role, nixl_agent_config(backends=[]))
    agent.create_backend("UCX", {"ucx_error_handling_mode": "peer" if args.eh == "on" else "none",
                                 "num_workers": "1"})
    agent.register_memory(agent.get_reg_descs([(base, args.bytes, 0, "")], "DRAM"))
    _say({"metadata": base64.b64encode(agent.get_agent_metadata()).decode(), "addr": base})

    remote, remote_addr = "", 0
    pending: set[bytes] = set()
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "peer":
            remote = agent.add_remote_agent(base64.b64decode(command["metadata"]))
            remote_addr = int(command["addr"])
            if isinstance(remote, bytes):
                remote = remote.decode()
            _say({"peer": remote})
        elif op == "write":
            segments = command["segments"]
            local = agent.get_xfer_descs([(base + s, n, 0) for s, _, n in segments], "DRAM")
            far = agent.get_xfer_descs([(remote_addr + d, n, 0) for _, d, n in segments], "DRAM")
            handle = agent.initialize_xfer("WRITE", local, far, remote, command["id"].encode())
            state = agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                time.sleep(POLL_S)
                state = agent.check_xfer_state(handle)
            agent.release_xfer_handle(handle)
            _say({"sent": command["id"], "state": state})
        elif op == "await":
            want = command["id"].encode()
            while want not in pending:
                for messages in agent.get_new_notifs().values():
                    pending.update(messages)
                if want not in pending:
                    time.sleep(POLL_S)
            pending.discard(want)
            _say({"done": command["id"]})
        elif op == "fill":
            array[:] = np.random.default_rng(command["seed"]).integers(0, 256, array.size, np.uint8)
            _say({"filled": command["seed"]})
        elif op == "digest":
            digest = hashlib.sha256()
            for offset, nbytes in command["segments"]:
                digest.update(array[offset:offset + nbytes].tobytes())
            _say({"digest": digest.hexdigest()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
