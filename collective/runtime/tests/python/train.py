"""Data-parallel linear regression in numpy: parameters are identical on every rank after every step."""
import sys

import numpy as np

import hvd
import hvd.numpy as hnp

hvd.init()
r, n = hvd.rank(), hvd.size()
rng = np.random.default_rng(r)  # each rank its own data and its own (different) initial parameters
true_w = np.arange(1, 9, dtype=np.float64)
x = rng.normal(size=(256, 8))
y = x @ true_w + 0.01 * rng.normal(size=256)
params = {"w": rng.normal(size=8), "b": rng.normal(size=1)}
hnp.broadcast_parameters(params, root_rank=0)
for step in range(200):
    pred = x @ params["w"] + params["b"]
    err = pred - y
    grads = {"w": x.T @ err / len(y), "b": np.array([err.mean()])}
    grads = hnp.allreduce_gradients(grads)
    for k in params:
        params[k] -= 0.1 * grads[k]
    flat = np.concatenate([params["w"], params["b"]])
    every = hvd.allgather(flat[None, :], name="check")
    if not all(np.array_equal(every[0], every[k]) for k in range(n)):
        print("parameters differ at step {}".format(step), file=sys.stderr)
        sys.exit(1)
assert np.allclose(params["w"], true_w, atol=0.05), params["w"]
hvd.shutdown()
print("ok train rank {} loss {:.5f}".format(r, float((err ** 2).mean())))
