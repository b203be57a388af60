"""hvd.tensorflow end to end (opt-in: needs tensorflow): eager CPU tensors through DLPack, broadcast_variables,
DistributedGradientTape; a data-parallel Keras-free regression with identical variables on every rank after every
step."""
import sys

import numpy as np
import tensorflow as tf

import hvd.tensorflow as hvd


def fail(message):
    print("rank {}: {}".format(hvd.rank(), message), file=sys.stderr)
    sys.exit(1)


hvd.init()
r, n = hvd.rank(), hvd.size()
for dtype in (tf.float32, tf.float64, tf.float16, tf.bfloat16, tf.int32, tf.int64, tf.uint8):
    x = tf.cast(tf.range(6) + r, dtype)
    got = hvd.allreduce(x, op=hvd.Sum, name="dtype.{}".format(dtype.name))
    want = tf.cast(sum(tf.range(6) + k for k in range(n)), dtype)
    if not tf.is_tensor(got) or got.dtype != dtype or not bool(tf.reduce_all(got == want)):
        fail("allreduce {}: got {!r} want {!r}".format(dtype.name, got, want))
g = hvd.allgather(tf.fill([r + 1, 2], r), name="gather")
if tuple(g.shape) != (n * (n + 1) // 2, 2):
    fail("allgather shape {}".format(g.shape))

rng = np.random.default_rng(r)
x = tf.constant(rng.normal(size=(128, 4)), tf.float32)
y = tf.linalg.matvec(x, tf.constant([1.0, 2.0, 3.0, 4.0]))
w = tf.Variable(rng.normal(size=4).astype(np.float32))
b = tf.Variable(np.float32(r))
hvd.broadcast_variables([w, b], root_rank=0)
for step in range(30):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((tf.linalg.matvec(x, w) + b - y) ** 2)
    tape = hvd.DistributedGradientTape(tape)
    gw, gb = tape.gradient(loss, [w, b])
    w.assign_sub(0.1 * gw)
    b.assign_sub(0.1 * gb)
    every = hvd.allgather_object(np.concatenate([w.numpy(), [b.numpy()]]).tobytes())
    if any(e != every[0] for e in every):
        fail("variables differ at step {}".format(step))
if not np.allclose(w.numpy(), [1.0, 2.0, 3.0, 4.0], atol=0.1):
    fail("did not converge: {}".format(w.numpy()))
hvd.shutdown()
print("ok tensorflow rank {}".format(r))
