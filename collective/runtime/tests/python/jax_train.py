"""hvd.jax end to end (opt-in: needs jax): JAX CPU arrays through DLPack, broadcast_parameters and
allreduce_gradients on pytrees; a data-parallel linear regression with identical parameters on every rank after
every step."""
import sys

import jax
import jax.numpy as jnp
import numpy as np

import hvd.jax as hvd


def fail(message):
    print("rank {}: {}".format(hvd.rank(), message), file=sys.stderr)
    sys.exit(1)


hvd.init()
r, n = hvd.rank(), hvd.size()
for dtype in (jnp.float32, jnp.float16, jnp.bfloat16, jnp.int32, jnp.uint8):
    x = (jnp.arange(6) + r).astype(dtype)
    got = hvd.allreduce(x, op=hvd.Sum, name="dtype.{}".format(jnp.dtype(dtype).name))
    want = sum((jnp.arange(6) + k).astype(dtype) for k in range(n)).astype(dtype)
    if not isinstance(got, jax.Array) or got.dtype != want.dtype or not bool(jnp.array_equal(got, want)):
        fail("allreduce {}: got {!r} want {!r}".format(dtype, got, want))
g = hvd.allgather(jnp.full((r + 1, 2), r, jnp.int32), name="gather")
if g.shape != (n * (n + 1) // 2, 2):
    fail("allgather shape {}".format(g.shape))

key = jax.random.PRNGKey(r)  # every rank starts elsewhere and has its own data
kx, kw = jax.random.split(key)
x = jax.random.normal(kx, (128, 4))
true_w = jnp.arange(1.0, 5.0)
y = x @ true_w
params = {"w": jax.random.normal(kw, (4,)), "b": jnp.zeros(())}
params = hvd.broadcast_parameters(params, root_rank=0)


def loss(p):
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


grad = jax.jit(jax.grad(loss))
for step in range(30):
    grads = hvd.allreduce_gradients(grad(params))
    params = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
    flat = np.concatenate([np.asarray(params["w"]), np.asarray(params["b"]).reshape(1)])
    every = hvd.allgather_object(flat.tobytes())
    if any(e != every[0] for e in every):
        fail("parameters differ at step {}".format(step))
if not np.allclose(np.asarray(params["w"]), np.arange(1.0, 5.0), atol=0.1):
    fail("did not converge: {}".format(params["w"]))
hvd.shutdown()
print("ok jax rank {}".format(r))
