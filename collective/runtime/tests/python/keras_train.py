"""hvd.keras end to end (opt-in: needs tensorflow; Keras 2 or 3): Horovod's Keras API as `horovod.tensorflow.keras`
gives it; each check compares with values computed here."""
import os
import sys
import tempfile

import numpy as np
import tensorflow as tf

import horovod.keras as hvd_keras
import horovod.tensorflow.keras as hvd


def fail(message):
    print("rank {}: {}".format(hvd.rank(), message), file=sys.stderr)
    sys.exit(1)


def same_everywhere(values, what):
    blob = np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in values]).tobytes()
    if any(b != blob for b in hvd.allgather_object(blob)):
        fail("{} differ between ranks".format(what))


hvd.init()
r, n = hvd.rank(), hvd.size()
assert hvd_keras.DistributedOptimizer is hvd.DistributedOptimizer

# Collectives of Keras values return tf.Tensors, in eager mode and inside tf.function.
got = hvd.allreduce(np.full(3, float(r)), name="k.allreduce")
if not tf.is_tensor(got) or not np.allclose(got.numpy(), (n - 1) / 2.0):
    fail("allreduce: {!r}".format(got))
got = hvd.allreduce([float(r + 1)], op=hvd.Sum, name="k.sum")
if not np.allclose(got.numpy(), n * (n + 1) / 2.0):
    fail("allreduce sum: {!r}".format(got))
got = hvd.allgather(np.full((r + 1, 2), r, np.int32), name="k.allgather")
if tuple(got.shape) != (n * (n + 1) // 2, 2) or got.dtype != tf.int32:
    fail("allgather: {!r}".format(got))
got = hvd.broadcast(np.float32(r + 5), root_rank=n - 1, name="k.broadcast")
if got.shape != () or float(got) != float(n + 4):
    fail("broadcast of a scalar: {!r}".format(got))
got = hvd.reducescatter(np.ones((2 * n, 3), np.float32) * r, op=hvd.Sum, name="k.reducescatter")
if tuple(got.shape) != (2, 3) or not np.allclose(got.numpy(), n * (n - 1) / 2.0):
    fail("reducescatter: {!r}".format(got))
got = hvd.alltoall(np.arange(n, dtype=np.float32) + 10 * r, name="k.alltoall")
if not np.allclose(got.numpy(), [10 * k + r for k in range(n)]):
    fail("alltoall: {!r}".format(got))


@tf.function
def in_function(x):
    return hvd.allreduce(x, op=hvd.Sum, name="k.in_function")


got = in_function(tf.constant([1.0, 2.0]))
if not np.allclose(got.numpy(), [n, 2.0 * n]):
    fail("allreduce in tf.function: {!r}".format(got))

# Options Horovod refuses are refused.
for bad in (dict(op=hvd.Adasum), dict(op=hvd.Max), dict(backward_passes_per_step=0), dict(groups=-1)):
    try:
        hvd.DistributedOptimizer(tf.keras.optimizers.SGD(), **bad)
    except ValueError:
        pass
    else:
        fail("DistributedOptimizer accepted {}".format(bad))
try:
    hvd.broadcast_global_variables(0)
except RuntimeError as e:
    if "broadcast_variables" not in str(e):
        fail("broadcast_global_variables in eager mode: {}".format(e))
else:
    fail("broadcast_global_variables ran in eager mode")

# The reduced gradients are the average (or sum) of every rank's, dense and sparse, with fp16 compression and a
# predivide factor: x has gradient r + 1, the gathered row of e gets r + 1.
for kwargs, scale in ((dict(), (n + 1) / 2.0), (dict(op=hvd.Sum), n * (n + 1) / 2.0),
                      (dict(compression=hvd.Compression.fp16), (n + 1) / 2.0),
                      (dict(gradient_predivide_factor=2.0), (n + 1) / 2.0),
                      (dict(sparse_as_dense=True), (n + 1) / 2.0)):
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(1.0), **kwargs)
    x = tf.Variable([0.0, 0.0])
    e = tf.Variable(np.zeros((4, 2), np.float32))

    def loss():
        return tf.reduce_sum(x) * (r + 1) + tf.reduce_sum(tf.gather(e, [r % 4])) * (r + 1)

    grads = dict((v.ref(), g) for g, v in opt._compute_gradients(loss, [x, e]))
    gx, ge = grads[x.ref()], tf.convert_to_tensor(grads[e.ref()])
    want = np.zeros((4, 2))
    for k in range(n):
        want[k % 4] += (k + 1) * (scale / (n * (n + 1) / 2.0))
    if not np.allclose(gx.numpy(), scale) or not np.allclose(ge.numpy(), want):
        fail("gradients with {}: {} {} want {} {}".format(kwargs, gx.numpy(), ge.numpy(), scale, want))
    if ("sparse_as_dense" in kwargs) == isinstance(grads[e.ref()], tf.IndexedSlices):
        fail("sparse_as_dense={} gave {}".format("sparse_as_dense" in kwargs, type(grads[e.ref()])))

# Horovod's tests and Keras 2 scripts compute and apply in a tf.function with experimental_aggregate_gradients=False
# (Keras 2's flag; Keras 3's apply_gradients has none): applied once, with the averaged gradient.
opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(1.0))
x = tf.Variable([0.0, 0.0])


@tf.function
def compute_and_apply():
    opt.apply_gradients(opt._compute_gradients(lambda: tf.reduce_sum(x) * (r + 1), [x]),
                        experimental_aggregate_gradients=False)


compute_and_apply()
if not np.allclose(x.numpy(), -(n + 1) / 2.0):
    fail("apply_gradients(experimental_aggregate_gradients=False) gave {}, want {}".format(x.numpy(), -(n + 1) / 2.0))

# A process set: a rank outside it, or in a set of one rank, keeps its own gradients (Horovod's _allreduce_cond).
ps = hvd.add_process_set([0])
opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(1.0), process_set=ps)
x = tf.Variable([0.0])
(g, _), = opt._compute_gradients(lambda: tf.reduce_sum(x) * (r + 1), [x])
if not np.allclose(tf.convert_to_tensor(g).numpy(), [r + 1]):
    fail("gradient with a process set this rank is {}in: {}".format("" if r == 0 else "not ", g))
hvd.remove_process_set(ps)

# model.fit: different data and initial weights on every rank; after the callbacks' broadcast and averaged
# gradients every rank holds the same weights, and the averaged metrics are the same everywhere.
rng = np.random.default_rng(r)
x = rng.normal(size=(64, 3)).astype(np.float32)
y = x @ np.array([[1.0], [-2.0], [0.5]], np.float32)
tf.keras.utils.set_random_seed(r)
model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(4, activation="tanh"),
                             tf.keras.layers.Dense(1)])
opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.05 * n, momentum=0.5), backward_passes_per_step=2,
                               average_aggregated_gradients=True)
model.compile(loss=tf.keras.losses.MeanSquaredError(), optimizer=opt)
history = model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    hvd.callbacks.MetricAverageCallback(),
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.05 * n, warmup_epochs=2),
])
same_everywhere(model.get_weights(), "weights after fit")
same_everywhere(history.history["loss"], "averaged losses")
if not np.isclose(history.history["lr"][-1], 0.05 * n):
    fail("warmup did not end at the full rate: {}".format(history.history["lr"]))
if int(opt.iterations.numpy()) != 3 * 8:
    fail("iterations {}".format(opt.iterations.numpy()))

# load_model wraps the saved optimizer again (Keras 3 saves `.keras` files only).
keras2 = hasattr(tf.keras.optimizers.Optimizer, "compute_gradients")
path = os.path.join(tempfile.mkdtemp(), "model.h5" if keras2 else "model.keras")
model.save(path)
loaded = hvd.load_model(path)
if not hasattr(loaded.optimizer, "register_local_var") or type(loaded.optimizer).__name__ != "SGD":
    fail("load_model gave {}".format(type(loaded.optimizer).__mro__))
loaded.fit(x, y, batch_size=8, epochs=1, verbose=0)
same_everywhere(loaded.get_weights(), "weights after fitting the loaded model")

# KerasState: sync gives rank 0's weights, restore goes back to the commit.
state = hvd.elastic.KerasState(model, batch=r, epoch=10 + r)
model.set_weights([w + r for w in model.get_weights()])
state.sync()
same_everywhere(model.get_weights(), "weights after sync")
if state.batch != 0 or state.epoch != 10:
    fail("state after sync: batch {} epoch {}".format(state.batch, state.epoch))
synced = model.get_weights()
model.set_weights([w * 0 for w in synced])
state.restore()
if not all(np.array_equal(a, b) for a, b in zip(model.get_weights(), synced)):
    fail("restore did not bring back the synced weights")

hvd.shutdown()
print("ok keras rank {}".format(r))
