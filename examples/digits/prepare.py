"""Split scikit-learn's bundled handwritten digits (8x8 images, 1797 samples) into train and test sets.

The data set ships inside the scikit-learn package, so nothing is downloaded at run time.
"""

import argparse
import os

import numpy as np
from sklearn.datasets import load_digits


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="data")
    parser.add_argument("--test-fraction", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    digits = load_digits()
    x = digits.data.astype(np.float32) / 16.0  # pixel values are 0..16
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(args.seed).permutation(len(x))
    n_test = int(len(x) * args.test_fraction)
    test, train = order[:n_test], order[n_test:]

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "digits.npz")
    np.savez(path, x_train=x[train], y_train=y[train], x_test=x[test], y_test=y[test])
    print(f"wrote {path}: {len(train)} train, {len(test)} test samples")


if __name__ == "__main__":
    main()
