"""A two-layer perceptron in plain numpy: forward, backward and accuracy written out."""

import numpy as np


def init_params(rng, n_in=64, n_hidden=128, n_out=10):
    return {
        "w1": (rng.standard_normal((n_in, n_hidden)) * np.sqrt(2.0 / n_in)).astype(np.float32),
        "b1": np.zeros(n_hidden, dtype=np.float32),
        "w2": (rng.standard_normal((n_hidden, n_out)) * np.sqrt(2.0 / n_hidden)).astype(np.float32),
        "b2": np.zeros(n_out, dtype=np.float32),
    }


def forward(params, x):
    h_pre = x @ params["w1"] + params["b1"]
    h = np.maximum(h_pre, 0.0)
    logits = h @ params["w2"] + params["b2"]
    return h_pre, h, logits


def softmax(logits):
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def loss_and_grads(params, x, y):
    """Mean cross-entropy over the batch and its gradients."""
    h_pre, h, logits = forward(params, x)
    p = softmax(logits)
    n = len(x)
    loss = float(-np.log(p[np.arange(n), y] + 1e-12).mean())
    d_logits = p
    d_logits[np.arange(n), y] -= 1.0
    d_logits /= n
    grads = {"w2": h.T @ d_logits, "b2": d_logits.sum(axis=0)}
    d_h = d_logits @ params["w2"].T
    d_h[h_pre <= 0.0] = 0.0
    grads["w1"] = x.T @ d_h
    grads["b1"] = d_h.sum(axis=0)
    return loss, {k: v.astype(np.float32) for k, v in grads.items()}


def accuracy(params, x, y):
    _, _, logits = forward(params, x)
    return float((logits.argmax(axis=1) == y).mean())
