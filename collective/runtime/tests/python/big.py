"""Large tensors (past the 1 MiB fusion bypass) mixed with small ones, async, fusion on: results are right."""
import sys

import numpy as np

import hvd

hvd.init()
r, n = hvd.rank(), hvd.size()
sizes = [int(1024 * (1024 ** (i / 19))) for i in range(20)]  # 4 KiB .. 4 MiB of float32
for step in range(3):
    xs = [np.full(s, r + 1 + step, np.float32) for s in sizes]
    hs = [hvd.allreduce_async_(x, op=hvd.Sum, name="big.{}".format(i)) for i, x in enumerate(xs)]
    for h in hs:
        hvd.synchronize(h)
    want = sum(k + 1 + step for k in range(n))
    for s, x in zip(sizes, xs):
        if not (x == want).all():
            print("size {} step {}: got {} want {}".format(s, step, x[:3], want), file=sys.stderr)
            sys.exit(1)
hvd.shutdown()
print("ok big rank {}".format(r))
