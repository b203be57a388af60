"""A real `horovod.tensorflow` script: a small Keras model on synthetic data, trained data-parallel.

hvd.init() joins the job through Horovod's gloo rendezvous (served by `hvd run`), the DistributedGradientTape
averages gradients with allreduce, the initial variables are broadcast from rank 0, and only rank 0 writes
checkpoints. At the end every rank checks that its weights equal rank 0's (one more allreduce).
"""

import argparse
import os

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--checkpoint-dir", default="checkpoints")
    args = parser.parse_args()

    hvd.init()
    rank, size = hvd.rank(), hvd.size()

    # A linear teacher: y = x @ w_true + noise. Each rank draws its own shard.
    rng = np.random.default_rng(rank)
    w_true = np.arange(1, 9, dtype=np.float32).reshape(8, 1) / 8.0
    x = rng.normal(size=(2048, 8)).astype(np.float32)
    y = x @ w_true + 0.01 * rng.normal(size=(2048, 1)).astype(np.float32)
    data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(2048, seed=rank).batch(args.batch_size)

    model = tf.keras.Sequential([tf.keras.layers.Dense(16, activation="relu"), tf.keras.layers.Dense(1)])
    model.build((None, 8))
    optimizer = tf.keras.optimizers.SGD(0.01 * size)
    loss_fn = tf.keras.losses.MeanSquaredError()

    @tf.function
    def train_step(xb, yb, first):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        if first:
            # After the first step, so that the optimizer's slots exist too.
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(optimizer.variables(), root_rank=0)
        return loss

    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    first = True
    for epoch in range(args.epochs):
        losses = []
        for xb, yb in data:
            losses.append(float(train_step(xb, yb, tf.constant(first))))
            first = False
        mean = float(hvd.allreduce(tf.constant(np.mean(losses)), op=hvd.Average))
        if rank == 0:
            print(f"epoch {epoch + 1}: loss {mean:.5f}")
            checkpoint.save(os.path.join(args.checkpoint_dir, "ckpt"))

    # Data parallelism keeps every rank's weights identical: compare with rank 0's.
    for variable in model.trainable_variables:
        mine = variable.numpy()
        theirs = hvd.broadcast(variable, root_rank=0).numpy()
        if not np.allclose(mine, theirs):
            raise SystemExit(f"rank {rank}: {variable.name} differs from rank 0's")
    total = float(hvd.allreduce(tf.constant(float(rank + 1)), op=hvd.Sum))
    expected = size * (size + 1) / 2
    if total != expected:
        raise SystemExit(f"rank {rank}: allreduce sum {total}, expected {expected}")
    print(f"rank {rank}/{size}: weights match rank 0; allreduce sum {total} == {expected}")


if __name__ == "__main__":
    main()
