"""Data-parallel PyTorch through hvd.torch, Horovod's API with no compiled extension.

Every rank draws its own shard of a synthetic classification problem (two interleaved spirals, so the model must
learn something non-linear); rank 0's initial parameters and optimizer state are broadcast; the DistributedOptimizer
averages each gradient across ranks as backward produces it. Rank 0 prints progress and alone writes the checkpoint.
At the end every rank checks that its parameters equal rank 0's.
"""

import argparse
import hashlib
import os

import numpy as np
import torch

import hvd.torch as hvd


def spirals(n, rng):
    """n points of two interleaved spirals in 2-d, labels 0/1."""
    t = rng.uniform(0.5, 3.5 * np.pi, size=n)
    label = rng.integers(0, 2, size=n)
    r = t / (3.5 * np.pi)
    angle = t + np.pi * label
    x = np.stack([r * np.cos(angle), r * np.sin(angle)], axis=1) + rng.normal(0, 0.02, size=(n, 2))
    return torch.tensor(x, dtype=torch.float32), torch.tensor(label, dtype=torch.int64)


def digest(model):
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=0.02, help="per rank; scaled by the number of ranks")
    parser.add_argument("--checkpoint", default="checkpoints/model.pt")
    args = parser.parse_args()

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(1234 + rank)  # different initial weights per rank: the broadcast must make them equal
    torch.set_num_threads(1)

    x_train, y_train = spirals(4096 // size, np.random.default_rng(7 + rank))
    x_test, y_test = spirals(1024, np.random.default_rng(99))

    model = torch.nn.Sequential(
        torch.nn.Linear(2, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * size)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    loss_fn = torch.nn.CrossEntropyLoss()
    steps = len(x_train) // args.batch_size
    for epoch in range(args.epochs):
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch * 1000 + rank))
        total = 0.0
        for step in range(steps):
            batch = order[step * args.batch_size : (step + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = loss_fn(model(x_train[batch]), y_train[batch])
            loss.backward()
            optimizer.step()
            total += loss.item()
        mean_loss = hvd.allreduce(torch.tensor([total / steps]), name="epoch_loss").item()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(dim=1) == y_test).float().mean().item()
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: loss {mean_loss:.4f}, test accuracy {accuracy:.3f}", flush=True)

    digests = hvd.allgather_object(digest(model))
    same = all(d == digests[0] for d in digests)
    print(f"rank {rank}/{size}: parameters {'match' if same else 'DIFFER FROM'} rank 0", flush=True)
    if rank == 0:
        os.makedirs(os.path.dirname(args.checkpoint) or ".", exist_ok=True)
        torch.save(model.state_dict(), args.checkpoint)
        print(f"final test accuracy {accuracy:.3f}; checkpoint {args.checkpoint}", flush=True)
    if not same:
        raise SystemExit(f"rank {rank}: parameters differ from rank 0's")
    hvd.shutdown()


if __name__ == "__main__":
    main()
