"""Evaluate rank 0's checkpoint on the held-out test set."""

import argparse
import sys

import numpy as np

from model import accuracy


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="data/digits.npz")
    parser.add_argument("--checkpoint", default="checkpoints/model.npz")
    parser.add_argument("--min-accuracy", type=float, default=0.95)
    args = parser.parse_args()

    data = np.load(args.data)
    params = dict(np.load(args.checkpoint))
    acc = accuracy(params, data["x_test"], data["y_test"])
    print(f"test accuracy {acc:.4f} ({len(data['y_test'])} samples)")
    if acc < args.min_accuracy:
        print(f"accuracy below {args.min_accuracy}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
