"""Uneven data: rank r has r + 2 batches, then joins; joined ranks contribute zeros."""
import sys

import numpy as np

import hvd

hvd.init()
r, n = hvd.rank(), hvd.size()
for step in range(r + 2):
    got = hvd.allreduce(np.array([1.0, step], np.float64), op=hvd.Sum, name="grad")
    contributing = sum(1 for k in range(n) if k + 2 > step)
    if not np.array_equal(got, [contributing, step * contributing]):
        print("step {}: got {} with {} contributing".format(step, got, contributing), file=sys.stderr)
        sys.exit(1)
last = hvd.join()
assert last == n - 1, last
# Everything works normally after the join.
assert hvd.allreduce(np.ones(2), op=hvd.Sum, name="after")[0] == n
hvd.shutdown()
print("ok join rank {} last {}".format(r, last))
