"""Mismatched shapes and dtypes turn into an error on every rank; the job continues afterwards."""
import sys

import numpy as np

import hvd

hvd.init()
r, n = hvd.rank(), hvd.size()
errors = []
try:
    hvd.allreduce(np.ones(3 if r == n - 1 else 2, np.float32), name="shape")
except hvd.HvdError as e:
    errors.append(str(e))
try:
    hvd.allreduce(np.ones(2, np.int32 if r == 0 else np.float32), name="dtype")
except hvd.HvdError as e:
    errors.append(str(e))
try:
    hvd.broadcast(np.ones(2), root_rank=r % 2, name="root")
except hvd.HvdError as e:
    errors.append(str(e))
ok = hvd.allreduce(np.ones(2), op=hvd.Sum, name="after")
hvd.shutdown()
print("\n".join(errors))
assert len(errors) == 3, errors
assert "mismatched shapes" in errors[0] and "rank {}: [3]".format(n - 1) in errors[0], errors[0]
assert "mismatched data types" in errors[1] and "rank 0: int32" in errors[1], errors[1]
assert "mismatched root ranks" in errors[2], errors[2]
assert ok[0] == n
print("ok mismatch rank {}".format(r))
