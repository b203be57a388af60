"""hvd.tensorflow in graph mode and eager (opt-in: needs tensorflow): the same checks in a tf.compat.v1 graph run by
a session and eagerly. Collectives return tf.Tensors with static shapes, gradients are Horovod's (allreduce,
allgather, broadcast, alltoall), tf.IndexedSlices are allgathered, a disagreement between the ranks is a
FailedPreconditionError and the job goes on, many collectives of one graph run in whatever order each rank picks,
*_op functions run when the graph runs, a process set that is not the job's is refused (ValueError),
broadcast_global_variables and DistributedOptimizer (tf.compat.v1, also with backward_passes_per_step),
elastic.TensorFlowState, horovod.tensorflow.mpi_ops."""
import os
import sys

import numpy as np
import tensorflow as tf

import hvd.tensorflow as hvd


def fail(message):
    print("rank {}: {}".format(hvd.rank(), message), file=sys.stderr)
    sys.exit(1)


def checks(run, mode):
    r, n = hvd.rank(), hvd.size()
    x = tf.constant([1.0, 2.0]) * tf.cast(r + 1, tf.float32)
    y = hvd.allreduce(x, op=hvd.Sum)
    if y.shape.as_list() != [2]:
        fail("{}: allreduce static shape {}".format(mode, y.shape))
    if not np.allclose(run(y), np.array([1.0, 2.0]) * sum(range(1, n + 1))):
        fail("{}: allreduce {}".format(mode, run(y)))
    # Many collectives of one graph at once: each rank's executor starts them in its own order.
    many = [hvd.allgather(tf.fill([k % 3 + 1, 2], r), name="many.{}".format(k)) for k in range(24)]
    got = run(many)
    for k, g in enumerate(got):
        want = np.concatenate([np.full([k % 3 + 1, 2], rank) for rank in range(n)])
        if not np.array_equal(g, want):
            fail("{}: allgather {} got {}".format(mode, k, g))
    # The ranks disagree (shapes): every rank fails with FailedPreconditionError, and the job goes on.
    try:
        run(hvd.allreduce(tf.ones([r + 2])))
        fail("{}: a shape mismatch did not fail".format(mode))
    except tf.errors.FailedPreconditionError:
        pass
    if run(hvd.size_op()) != n or run(hvd.rank_op()) != r:
        fail("{}: size_op/rank_op".format(mode))
    # A process set that is not one of the job's (never added, or an id set by hand): ValueError when the op is made.
    fake = hvd.ProcessSet([0])
    for ps_id in (None, 1000):
        fake.process_set_id = ps_id
        for what, make in (("allreduce", lambda: hvd.allreduce(tf.ones(2), process_set=fake)),
                           ("allgather", lambda: hvd.allgather(tf.ones(2), process_set=fake)),
                           ("broadcast", lambda: hvd.broadcast(tf.ones(2), 0, process_set=fake)),
                           ("alltoall", lambda: hvd.alltoall(tf.ones(2), process_set=fake)),
                           ("reducescatter", lambda: hvd.reducescatter(tf.ones(2), process_set=fake))):
            try:
                make()
            except ValueError as e:
                if "not a process set of this job" not in str(e):
                    fail("{}: {} with process set id {}: another ValueError: {}".format(mode, what, ps_id, e))
            else:
                fail("{}: {} with process set id {} was not refused".format(mode, what, ps_id))
    # IndexedSlices: values and indices gathered, averaged values divided by the size.
    sl = hvd.allreduce(tf.IndexedSlices(tf.ones([1, 2]) * (r + 1), tf.constant([r])), op=hvd.Average)
    values, indices = run([sl.values, sl.indices])
    if not np.allclose(values, [[(k + 1) / n] * 2 for k in range(n)]) or list(indices) != list(range(n)):
        fail("{}: IndexedSlices {} {}".format(mode, values, indices))


def gradients(mode, grad_of):
    r, n = hvd.rank(), hvd.size()
    x = tf.constant([[1.0, 2.0]]) * (r + 1)
    sum_grad = grad_of(lambda t: hvd.allreduce(t, op=hvd.Sum), x)
    if not np.allclose(sum_grad, [[n, n]]):
        fail("{}: allreduce gradient {}".format(mode, sum_grad))
    gather_grad = grad_of(lambda t: hvd.allgather(t), x)
    if not np.allclose(gather_grad, [[1.0, 1.0]]):
        fail("{}: allgather gradient {}".format(mode, gather_grad))
    bcast_grad = grad_of(lambda t: hvd.broadcast(t, 0), x)
    if not np.allclose(bcast_grad, [[1.0, 1.0]] if r == 0 else [[0.0, 0.0]]):
        fail("{}: broadcast gradient {}".format(mode, bcast_grad))
    rows = tf.reshape(tf.range(2 * n, dtype=tf.float32), [2 * n, 1])
    a2a_grad = grad_of(lambda t: hvd.alltoall(t, splits=[2] * n)[0] * 3.0, rows)
    if not np.allclose(a2a_grad, np.full([2 * n, 1], 3.0)):
        fail("{}: alltoall gradient {}".format(mode, a2a_grad))


hvd.init()
r, n = hvd.rank(), hvd.size()

# Eager execution keeps TensorFlow's inter-op threads (one per core); sessions get 64, since each collective of a
# graph holds one until every rank submitted it (with one per core, `many` below would wait forever).
if "TF_NUM_INTEROP_THREADS" in os.environ or tf.config.threading.get_inter_op_parallelism_threads() != 0:
    fail("import hvd.tensorflow changed eager execution's inter-op threads")
graph = tf.Graph()
with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
    if sess._config.inter_op_parallelism_threads != max(64, os.cpu_count()):
        fail("a session got {} inter-op threads".format(sess._config.inter_op_parallelism_threads))
    checks(sess.run, "graph")
    gradients("graph", lambda f, x: sess.run(tf.gradients(tf.reduce_sum(f(x)), x)[0]))
    v = tf.compat.v1.Variable([float(r), float(r)])
    sess.run(tf.compat.v1.global_variables_initializer())
    sess.run(hvd.broadcast_global_variables(0))
    if not np.allclose(sess.run(v), [0.0, 0.0]):
        fail("graph: broadcast_global_variables {}".format(sess.run(v)))
    # DistributedOptimizer: each rank's gradient is r + 1; the step applies their average.
    w = tf.compat.v1.Variable([0.0])
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0))
    step = opt.minimize(tf.reduce_sum(w * float(r + 1)), var_list=[w])
    sess.run(tf.compat.v1.variables_initializer([w]))
    sess.run(step)
    if not np.allclose(sess.run(w), [-sum(range(1, n + 1)) / n]):
        fail("graph: DistributedOptimizer step {}".format(sess.run(w)))
    # backward_passes_per_step=4: rank r's gradient is r; every 4th step applies the average of the 4 passes' mean.
    a = tf.compat.v1.Variable([0.0])
    steps = tf.compat.v1.Variable(0, dtype=tf.int64, trainable=False)
    agg = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(-1.0), backward_passes_per_step=4,
                                   average_aggregated_gradients=True)
    apply = agg.apply_gradients(agg.compute_gradients(tf.reduce_sum(a * float(r)), var_list=[a]), global_step=steps)
    sess.run([tf.compat.v1.variables_initializer([a, steps]), tf.compat.v1.local_variables_initializer()])
    seen = []
    for _ in range(9):
        sess.run(apply)
        seen.append((float(sess.run(a)[0]), int(sess.run(steps))))
    mean = sum(range(n)) / n
    want = [(mean * ((k + 1) // 4), k + 1) for k in range(9)]
    if not np.allclose(seen, want):
        fail("graph: backward_passes_per_step {} want {}".format(seen, want))


def eager_grad(f, x):
    with tf.GradientTape() as tape:
        tape.watch(x)
        out = tf.reduce_sum(f(x))
    return tape.gradient(out, x).numpy()


checks(lambda t: [e.numpy() for e in t] if isinstance(t, list) else t.numpy(), "eager")
gradients("eager", eager_grad)
if not tf.is_tensor(hvd.allgather(tf.ones([1]))):
    fail("eager: allgather of a tf.Tensor is not a tf.Tensor")
try:
    hvd.broadcast_global_variables(0)
    fail("eager: broadcast_global_variables did not refuse")
except RuntimeError:
    pass
# hvd.elastic.TensorFlowState (Horovod's tests reach it through the module): sync takes rank 0's variables and
# attributes, restore puts the last commit back.
state_vars = [tf.Variable([float(r), float(r)])]
state = hvd.elastic.TensorFlowState(state_vars, epoch=10 + r)
state.sync()
state_vars[0].assign([5.0, 5.0])
state.epoch = 99
state.restore()
if not np.allclose(state_vars[0].numpy(), [0.0, 0.0]) or state.epoch != 10:
    fail("eager: TensorFlowState {} {}".format(state_vars[0].numpy(), state.epoch))
# horovod.tensorflow.mpi_ops: the ops under Horovod's module name, and the sets the runtime knows, by id.
import horovod.tensorflow as horovod_tf  # noqa: E402

if horovod_tf.mpi_ops.allreduce is not hvd.allreduce:
    fail("horovod.tensorflow.mpi_ops.allreduce is not hvd.tensorflow's")
known = horovod_tf.mpi_ops._basics._get_process_set_ids_and_ranks
added = hvd.add_process_set([n - 1])
if known() != {0: list(range(n)), added.process_set_id: [n - 1]}:
    fail("process sets known after an add: {}".format(known()))
want = "ProcessSet(process_set_id={}, ranks=[{}], mpi_comm=None)".format(added.process_set_id, n - 1)
if str(added) != want:
    fail("str of a process set: {}".format(added))
hvd.remove_process_set(added)
if known() != {0: list(range(n))}:
    fail("process sets known after the remove: {}".format(known()))
# A session's own thread count stays its own.
own = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=3)
with tf.Graph().as_default(), tf.compat.v1.Session(config=own) as mine:
    if mine._config.inter_op_parallelism_threads != 3:
        fail("a session's own inter-op threads became {}".format(mine._config.inter_op_parallelism_threads))
hvd.shutdown()
print("ok tensorflow graph rank {}".format(r))
