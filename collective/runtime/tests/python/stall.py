"""Rank 1 submits `late.tensor` seconds after the others: rank 0's stall inspector names it (short thresholds)."""
import time

import numpy as np

import hvd

hvd.init()
r = hvd.rank()
if r == 1:
    time.sleep(3.0)
got = hvd.allreduce(np.ones(1), op=hvd.Sum, name="late.tensor")
assert got[0] == hvd.size()
hvd.shutdown()
print("ok stall rank {}".format(r))
