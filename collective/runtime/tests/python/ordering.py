"""Ranks submit the same named tensors in different orders, asynchronously; results must be right everywhere."""
import sys

import numpy as np

import hvd

hvd.init()
r, n = hvd.rank(), hvd.size()
steps, count = 30, 40
for step in range(steps):
    order = list(range(count))
    rng = np.random.default_rng(step * 100 + r)
    rng.shuffle(order)
    handles = {}
    for i in order:
        x = np.full(i + 1, r + step + i, np.float32)
        handles[i] = hvd.allreduce_async(x, op=hvd.Sum, name="grad.{}".format(i))
    for i in range(count):
        got = hvd.synchronize(handles[i])
        want = np.full(i + 1, sum(k + step + i for k in range(n)), np.float32)
        if not np.array_equal(got, want):
            print("step {} tensor {}: got {} want {}".format(step, i, got, want), file=sys.stderr)
            sys.exit(1)
# Grouped submission (one call into the library).
outs = hvd.grouped_allreduce([np.full(3, r, np.float64) for _ in range(5)], op=hvd.Average, name="grouped")
assert all(np.allclose(o, (n - 1) / 2) for o in outs), outs
# Unnamed operations (the timeline test checks that they share one lane per kind).
for _ in range(5):
    hvd.barrier()
    assert hvd.allreduce(np.ones(2, np.float32), op=hvd.Sum).tolist() == [n, n]
hvd.shutdown()
print("ok ordering rank {}".format(r))
