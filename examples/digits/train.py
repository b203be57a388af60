"""Data-parallel training of a small numpy network on the digits data set through `hvd`.

Every rank trains on its own shard; gradients are averaged with allreduce, so all ranks keep identical
parameters. Rank 0 broadcasts the initial parameters, prints progress and alone writes the checkpoint.
"""

import argparse
import os

import numpy as np

import hvd
from model import accuracy, init_params, loss_and_grads


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="data/digits.npz")
    parser.add_argument("--checkpoint", default="checkpoints/model.npz")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.1, help="per rank; scaled by the number of ranks")
    args = parser.parse_args()

    hvd.init()
    rank, size = hvd.rank(), hvd.size()

    data = np.load(args.data)
    x_train, y_train = data["x_train"], data["y_train"]
    x_test, y_test = data["x_test"], data["y_test"]
    # Each rank takes every size-th sample: disjoint shards of (almost) equal size.
    x_shard, y_shard = x_train[rank::size], y_train[rank::size]

    params = init_params(np.random.default_rng(1234 + rank))
    for name in sorted(params):
        params[name] = hvd.broadcast(params[name], root_rank=0, name=f"init.{name}")

    # The same number of steps on every rank, so every allreduce has a partner.
    steps = int(hvd.allreduce(np.array([len(x_shard) // args.batch_size], dtype=np.int64), op=hvd.Min)[0])
    # The averaged gradient is over size x batch-size samples: scale the learning rate with it (Horovod's rule).
    lr = args.lr * size
    rng = np.random.default_rng(99 + rank)
    for epoch in range(args.epochs):
        order = rng.permutation(len(x_shard))
        losses = []
        for step in range(steps):
            batch = order[step * args.batch_size : (step + 1) * args.batch_size]
            loss, grads = loss_and_grads(params, x_shard[batch], y_shard[batch])
            handles = {k: hvd.allreduce_async(g, op=hvd.Average, name=f"grad.{k}") for k, g in grads.items()}
            for k, handle in handles.items():
                params[k] -= lr * hvd.synchronize(handle)
            losses.append(loss)
        mean_loss = float(hvd.allreduce(np.array([np.mean(losses)], dtype=np.float64), op=hvd.Average)[0])
        if rank == 0:
            print(f"epoch {epoch + 1:3d}  loss {mean_loss:.4f}  test accuracy {accuracy(params, x_test, y_test):.4f}")

    if rank == 0:
        os.makedirs(os.path.dirname(args.checkpoint) or ".", exist_ok=True)
        np.savez(args.checkpoint, **params)
        print(f"wrote {args.checkpoint}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
