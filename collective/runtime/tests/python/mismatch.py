"""Mismatched shapes and dtypes turn into an error on every rank; the job continues afterwards."""
import sys

import numpy as np

import hvd

hvd.init()
r, n = hvd.rank(), hvd.size()
errors = []
# A mismatch is its own class: an HvdError, not a HorovodInternalError (the job goes on).
try:
    hvd.allreduce(np.ones(3 if r == n - 1 else 2, np.float32), name="shape")
except hvd.MismatchError as e:
    errors.append(str(e))
try:
    hvd.allreduce(np.ones(2, np.int32 if r == 0 else np.float32), name="dtype")
except hvd.MismatchError as e:
    errors.append(str(e))
try:
    hvd.broadcast(np.ones(2), root_rank=r % 2, name="root")
except hvd.HorovodInternalError:
    sys.exit("a mismatch raised HorovodInternalError")
except hvd.MismatchError as e:
    assert isinstance(e, hvd.HvdError)
    errors.append(str(e))
# A bad argument is refused at once, on this rank only.
try:
    hvd.broadcast(np.ones(2), root_rank=n, name="no.such.root")
    sys.exit("a root outside the job was accepted")
except hvd.InvalidArgumentError as e:
    assert isinstance(e, ValueError) and not isinstance(e, hvd.MismatchError), type(e)
ok = hvd.allreduce(np.ones(2), op=hvd.Sum, name="after")
hvd.shutdown()
try:
    hvd.allreduce(np.ones(2), name="after.shutdown")
    sys.exit("an allreduce after shutdown passed")
except hvd.NotInitializedError:
    pass
print("\n".join(errors))
assert len(errors) == 3, errors
# What differs, and on which rank.
assert "rank {}: [3]".format(n - 1) in errors[0], errors[0]
assert "rank 0: int32" in errors[1], errors[1]
assert "rank 1: 1" in errors[2], errors[2]
assert ok[0] == n
print("ok mismatch rank {}".format(r))
