"""A worker process for tests: attach to a daemon's pool and write a seeded pattern.

usage: python worker_write.py ADDRESS POOL SEED
Writes torch.manual_seed(SEED) random values into every view of the pool, then
prints the sum of each view (as float64) as one JSON list.
"""

import json
import sys

import torch

from kvxfer.client import KvxferClient

address, pool_name, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(seed)
with KvxferClient(address) as kv, kv.attach(pool_name) as pool:
    views = [*pool.views.k, *pool.views.v, *pool.views.latent, *pool.views.conv]
    if pool.views.temporal is not None:
        views.append(pool.views.temporal)
    sums = []
    for view in views:
        view.copy_(torch.randn(view.shape).to(view.dtype))
        sums.append(float(view.double().sum()))
    print(json.dumps(sums))
