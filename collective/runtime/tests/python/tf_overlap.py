"""hvd.tensorflow's gradient reduction in graph mode overlaps backward (opt-in: needs tensorflow): inside a
tf.function (and a tf.compat.v1 graph) DistributedGradientTape makes one submitting node per dense gradient, named
as Horovod names its ops, that depends on its own gradient only (so it runs while backward still computes the
others), and one waiting node. The results are those of the eager reduction: averages, Sum, integer truncation,
fp16 compression, predivide factor, IndexedSlices gathered or made dense, process_set=; a disagreement between the
ranks is a FailedPreconditionError and the next step works."""
import sys

import numpy as np
import tensorflow as tf

import hvd.tensorflow as hvd


def fail(message):
    print("rank {}: {}".format(hvd.rank(), message), file=sys.stderr)
    sys.exit(1)


hvd.init()
r, n = hvd.rank(), hvd.size()

# A chain of layers: backward makes the last layer's gradient first and the first layer's last.
rng = np.random.default_rng(7)
layers = [tf.Variable(rng.normal(size=(4, 4)).astype(np.float32) * 0.5, name="w{}".format(k)) for k in range(6)]
x = tf.constant(np.arange(8, dtype=np.float32).reshape(2, 4) + r)


def loss_fn():
    h = x
    for w in layers:
        h = tf.tanh(tf.matmul(h, w))
    return tf.reduce_sum(h * h)


def local_grads():
    with tf.GradientTape() as tape:
        loss = loss_fn()
    return tape.gradient(loss, layers)


@tf.function
def reduced_grads():
    with tf.GradientTape() as tape:
        loss = loss_fn()
    return hvd.DistributedGradientTape(tape).gradient(loss, layers)


# Every rank's local gradients, gathered eagerly: the expected average.
mine = [g.numpy() for g in local_grads()]
every = [hvd.allgather(tf.constant(g[None]), name="expect.{}".format(k)).numpy() for k, g in enumerate(mine)]
want = [e.mean(axis=0) for e in every]
for step in range(3):
    got = reduced_grads()
    for k, (g, w) in enumerate(zip(got, want)):
        if not np.allclose(g.numpy(), w, rtol=1e-5, atol=1e-6):
            fail("step {}: gradient {} got {} want {}".format(step, k, g.numpy(), w))

# The graph: a submitting node per gradient, named after its input, that does not wait for the earlier layers'
# gradients (the first layer's gradient is not among the inputs of the last layer's submission), and one wait.
graph = reduced_grads.get_concrete_function().graph
submits = [op for op in graph.get_operations() if op.type == "PyFunc" and op.name.startswith("HorovodAllreduce_")
           and "Wait" not in op.name]
waits = [op for op in graph.get_operations() if op.type == "PyFunc" and "HorovodAllreduceWait" in op.name]
if len(submits) != len(layers) or len(waits) != 1:
    fail("nodes: {} submitting, {} waiting: {}".format(len(submits), len(waits), [op.name for op in submits + waits]))


def ancestors(op):
    seen, todo = set(), [op]
    while todo:
        o = todo.pop()
        for t in list(o.inputs) + list(o.control_inputs):
            p = t.op if hasattr(t, "op") else t
            if p.name not in seen:
                seen.add(p.name)
                todo.append(p)
    return seen


# The submission with the fewest ancestors (the last layer's) does not wait for the first layer's gradient (the
# input of the submission with the most), and the wait depends on every submission.
first_submit = min(submits, key=lambda op: len(ancestors(op)))
last_submit = max(submits, key=lambda op: len(ancestors(op)))
if last_submit.inputs[0].op.name in ancestors(first_submit):
    fail("the first submission waits for the last gradient: {}".format(first_submit.name))
if not all(op.name in ancestors(waits[0]) for op in submits):
    fail("the wait does not depend on every submission")

# tf.function: Sum, integers (truncating average), fp16 compression, predivide factor, sparse and sparse_as_dense.
v = tf.Variable([1.0, 2.0, 3.0])
emb = tf.Variable(np.ones((5, 2), np.float32))


@tf.function
def options(op, compression, predivide, sparse_as_dense):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v * float(r + 1)) + tf.reduce_sum(tf.gather(emb, [r]) * float(r + 1))
    tape = hvd.DistributedGradientTape(tape, op=op, compression=compression,
                                       gradient_predivide_factor=predivide, sparse_as_dense=sparse_as_dense)
    return tape.gradient(loss, [v, emb])


total = sum(k + 1 for k in range(n))
for op, compression, predivide, dense in ((hvd.Average, hvd.Compression.none, 1.0, False),
                                          (hvd.Sum, hvd.Compression.fp16, 1.0, True),
                                          (hvd.Average, hvd.Compression.fp16, 2.0, True)):
    gv, gemb = options(op, compression, predivide, dense)
    scale = total if op == hvd.Sum else total / n
    if gv.dtype != tf.float32 or not np.allclose(gv.numpy(), [scale] * 3):
        fail("options {}: dense gradient {}".format((op, dense), gv))
    if dense != (not isinstance(gemb, tf.IndexedSlices)):
        fail("options {}: sparse_as_dense gave {}".format((op, dense), type(gemb)))
    dense_emb = tf.convert_to_tensor(gemb).numpy()
    want_emb = np.zeros((5, 2), np.float32)
    for k in range(n):
        want_emb[k] += (k + 1) / (1 if op == hvd.Sum else n)
    if not np.allclose(dense_emb, want_emb):
        fail("options {}: embedding gradient {} want {}".format((op, dense), dense_emb, want_emb))


@tf.function
def integers(t):
    return hvd._make_allreduce_grads(hvd.Compression.none, False, hvd.Average, 1.0, None, None)([t])[0]


got = integers(tf.constant([r * 3 + 1, -(r * 3 + 1)], tf.int32)).numpy()
vals = [k * 3 + 1 for k in range(n)]
if list(got) != [int(sum(vals) / n), -int(sum(vals) / n)]:
    fail("integer average {} (truncated: {})".format(got, int(sum(vals) / n)))

# A disagreement (a gradient's shape differs by rank): FailedPreconditionError, then the job goes on.
u = tf.Variable(tf.ones([r + 2]))


@tf.function
def mismatched():
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(u * u) + tf.reduce_sum(v)
    return hvd.DistributedGradientTape(tape).gradient(loss, [u, v])


try:
    mismatched()
    fail("a shape mismatch did not fail")
except tf.errors.FailedPreconditionError:
    pass
if not np.allclose(reduced_grads()[0].numpy(), want[0], rtol=1e-5, atol=1e-6):
    fail("after the mismatch: gradient")

# process_set= (the global set: a set of the same ranks would be a duplicate, which Horovod refuses).
everyone = hvd.global_process_set


@tf.function
def in_set():
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v * float(r + 1))
    return hvd.DistributedGradientTape(tape, process_set=everyone).gradient(loss, [v])[0]


if not np.allclose(in_set().numpy(), [total / n] * 3):
    fail("process set gradient {}".format(in_set().numpy()))

# tf.compat.v1 graph: the same nodes, run by a session.
graph = tf.Graph()
with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
    a = tf.compat.v1.Variable([float(r), 1.0])
    b = tf.compat.v1.Variable(2.0)
    loss = tf.reduce_sum(a * a) + b * float(r + 1)
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.0))
    pairs = opt.compute_gradients(loss, [a, b])
    sess.run(tf.compat.v1.global_variables_initializer())
    ga, gb = sess.run([g for g, _ in pairs])
    if not np.allclose(ga, [2 * sum(range(n)) / n, 2.0]) or not np.isclose(gb, total / n):
        fail("graph: gradients {} {}".format(ga, gb))
    names = [op.name for op in graph.get_operations() if op.type == "PyFunc"]
    if sum(1 for m in names if m.startswith("HorovodAllreduce_") and "Wait" not in m) != 2:
        fail("graph: submitting nodes {}".format(names))

hvd.shutdown()
print("rank {} ok".format(r))
