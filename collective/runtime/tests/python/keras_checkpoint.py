"""``KerasState.checkpoint()`` across a killed job (opt-in: needs tensorflow; Keras 2 or 3). The test runs it twice
with the same ``HVD_CHECKPOINT_DIR``:

- ``HVD_TEST_PHASE=first``: a model trained by ``hvd.elastic.run`` with a ``DistributedOptimizer`` (Adam; SGD with
  momentum under ``HVD_TEST_OPTIMIZER=sgd``; Keras 2's legacy SGD with momentum under ``HVD_TEST_OPTIMIZER=legacy``,
  which Keras 3 does not have), one batch per commit, checkpointed at commit 3;
  rank 0 keeps what the checkpoint must hold and what training on to commit 5 gives in ``HVD_TEST_EXPECT`` (the
  test's file); then every rank kills itself (SIGKILL) with work past the checkpoint;
- ``HVD_TEST_PHASE=resume``: a fresh model (other initial weights on each rank) and an optimizer that has made no
  step: ``hvd.elastic.run`` loads the checkpoint on rank 0 and syncs it, so every rank starts at batch 3 with the
  checkpoint's weights and optimizer variables, exactly; training on to batch 5 gives the first run's weights.

A ``TensorFlowState`` of variables goes through ``checkpoint()`` / ``load_checkpoint()`` too (``variables.npz``), and
a checkpoint of another model is refused with the state left at its commit."""
import os
import signal
import sys
import time

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd_tf
import horovod.tensorflow.keras as hvd
from hvd import elastic as E

PHASE = os.environ["HVD_TEST_PHASE"]
EXPECT = os.environ["HVD_TEST_EXPECT"]
OPTIMIZER = os.environ.get("HVD_TEST_OPTIMIZER", "adam")
if OPTIMIZER not in ("adam", "sgd", "legacy"):
    sys.exit("HVD_TEST_OPTIMIZER={!r}: want adam, sgd or legacy".format(OPTIMIZER))
STEPS, CHECKPOINT_AT = 5, 3


def fail(message):
    print("rank {}: {}".format(hvd.rank(), message), file=sys.stderr)
    sys.exit(1)


def flat(values):
    return np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in values]) if values else np.zeros(0)


def same_everywhere(values, what):
    blob = flat(values).tobytes()
    if any(b != blob for b in hvd.allgather_object(blob)):
        fail("{} differ between ranks".format(what))


def equal(got, want, what):
    if len(got) != len(want):
        fail("{}: {} values, want {}".format(what, len(got), len(want)))
    for i, (a, b) in enumerate(zip(got, want)):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype != b.dtype or a.shape != b.shape or not np.array_equal(a, b):
            fail("{}: value {} differs ({} {} vs {} {})".format(what, i, a.dtype, a.shape, b.dtype, b.shape))


hvd.init()
r = hvd.rank()


def build(seed):
    tf.keras.utils.set_random_seed(seed)
    model = tf.keras.Sequential([tf.keras.Input(shape=(4,)), tf.keras.layers.Dense(8, activation="relu"),
                                 tf.keras.layers.Dense(1)])
    if OPTIMIZER == "legacy":
        inner = tf.keras.optimizers.legacy.SGD(0.05, momentum=0.9)
    elif OPTIMIZER == "sgd":
        inner = tf.keras.optimizers.SGD(0.05, momentum=0.9)
    else:
        inner = tf.keras.optimizers.Adam(0.01)
    model.compile(optimizer=hvd.DistributedOptimizer(inner), loss="mse")
    return model


def batch(step):
    rng = np.random.default_rng(1000 * step + r)
    return rng.standard_normal((8, 4)).astype(np.float32), rng.standard_normal((8, 1)).astype(np.float32)


# Every rank starts from other weights: only the sync (and, on resume, the checkpoint) makes them equal.
model = build(seed=7 + r + (100 if PHASE == "resume" else 0))
state = hvd.elastic.KerasState(model, batch=0, epoch=0)
seen = {}


@hvd.elastic.run
def train(state):
    if "start" not in seen:
        seen["start"] = (state.batch, [v.numpy() for v in model.variables],
                         [v.numpy() for v in state._optimizer_variables()])
    while state.batch < STEPS:
        model.train_on_batch(*batch(state.batch))
        state.batch += 1
        state.commit()
        if PHASE == "first" and state.batch == CHECKPOINT_AT:
            path = state.checkpoint()
            if r == 0:
                if path is None or not all(os.path.isfile(os.path.join(path, f))
                                           for f in ("model.npz", "optimizer.npz", "state.json")):
                    fail("checkpoint() wrote {!r} without its files".format(path))
                seen["checkpoint"] = ([v.numpy() for v in model.variables],
                                      [v.numpy() for v in state._optimizer_variables()])


train(state)
same_everywhere(model.get_weights(), "weights after training")
final = [v.numpy() for v in model.variables]

if PHASE == "first":
    if r == 0:
        weights, slots = seen["checkpoint"]
        if len(slots) <= 1:
            fail("the optimizer has {} variables at the checkpoint: no slots".format(len(slots)))
        arrays = {"w{}".format(i): w for i, w in enumerate(weights)}
        arrays.update({"o{}".format(i): o for i, o in enumerate(slots)})
        arrays.update({"f{}".format(i): f for i, f in enumerate(final)})
        np.savez(EXPECT, counts=np.array([len(weights), len(slots)]), **arrays)
    # Work past the checkpoint (local: a collective could be cut short by the other rank's death), then the job dies
    # once every rank is past its last collective (each says so with a file next to HVD_TEST_EXPECT): no shutdown,
    # no exit handlers.
    for v in model.variables:
        v.assign_add(tf.ones_like(v))
    open("{}.done-{}".format(EXPECT, r), "w").close()
    deadline = time.time() + 60
    while not all(os.path.exists("{}.done-{}".format(EXPECT, i)) for i in range(hvd.size())):
        if time.time() > deadline:
            fail("the other ranks did not finish their collectives within 60 s")
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)

with np.load(EXPECT) as f:
    n_weights, n_slots = (int(c) for c in f["counts"])
    weights = [f["w{}".format(i)] for i in range(n_weights)]
    slots = [f["o{}".format(i)] for i in range(n_slots)]
    expected_final = [f["f{}".format(i)] for i in range(n_weights)]
start_batch, start_weights, start_slots = seen["start"]
if start_batch != CHECKPOINT_AT:
    fail("resumed at batch {}, want {}".format(start_batch, CHECKPOINT_AT))
equal(start_weights, weights, "model weights after resume")
equal(start_slots, slots, "optimizer variables after resume")
if getattr(state, "_hvd_commits", None) != STEPS:
    fail("commit count {} after resuming at {} and {} more steps".format(state._hvd_commits, CHECKPOINT_AT,
                                                                       STEPS - CHECKPOINT_AT))
equal(final, expected_final, "weights trained on from the checkpoint vs. the first run's")

# A checkpoint of another model (other shapes) is refused, and the state stays at its commit.
if r == 0:
    files = state._checkpoint_files()
    other = tf.keras.Sequential([tf.keras.Input(shape=(3,)), tf.keras.layers.Dense(2)])
    files["model.npz"] = E._variables_file([v.numpy() for v in other.variables])
    state.batch = 99
    try:
        state._checkpoint_load(files)
    except E._Refused as e:
        if "model.npz" not in str(e):
            fail("another model: refused for another reason: {}".format(e))
    else:
        fail("a checkpoint of another model was loaded")
    if state.batch != 99:
        fail("a refused checkpoint changed the live state")
    equal([v.numpy() for v in model.variables], final, "weights after a refused checkpoint")

# TensorFlowState: its variables and attributes through checkpoint() and load_checkpoint() (a directory of its own:
# its commits would move the Keras history's aside).
os.environ["HVD_CHECKPOINT_DIR"] = os.path.join(os.environ["HVD_CHECKPOINT_DIR"], "tf-state")
v1 = tf.Variable(np.arange(6, dtype=np.float32).reshape(2, 3) + r)
v2 = tf.Variable(np.int64(5 + r))
tf_state = hvd_tf.elastic.TensorFlowState([v1, v2], step=r)
tf_state.sync()
tf_state.commit()
committed = [v1.numpy(), v2.numpy()]
tf_state.checkpoint()
v1.assign(v1 * 0)
v2.assign(0)
if r == 0:
    fresh = hvd_tf.elastic.TensorFlowState([v1, v2], step=42)
    commit = fresh.load_checkpoint()
    if commit is None or fresh.step != 0:
        fail("TensorFlowState.load_checkpoint() gave commit {!r}, step {}".format(commit, fresh.step))
    equal([v1.numpy(), v2.numpy()], committed, "TensorFlowState variables after load_checkpoint")
    wrong = hvd_tf.elastic.TensorFlowState([tf.Variable(np.zeros(3, np.float32))], step=1)
    if wrong.load_checkpoint() is not None or wrong.step != 1:
        fail("a TensorFlowState of other variables loaded a checkpoint")

hvd.shutdown()
print("OK rank {}".format(r))
