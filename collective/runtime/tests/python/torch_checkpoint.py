"""``hvd.torch.elastic.TorchState``'s checkpoints with real torch (opt-in: needs torch >= 2.6; ``HVD_CHECKPOINT_DIR``
set by the test): a model and an SGD optimizer with momentum committed and checkpointed (``torch.pt``), loaded on
rank 0 into a fresh model and optimizer and synced to every rank (weights, momentum buffers, step attributes equal the
commit's); a ``torch.pt`` that would run code when unpickled is refused by ``weights_only`` (nothing runs, nothing
loaded), and one that does not fit the model is refused all or nothing (the state stays at its last commit)."""
import io
import os
import sys

import torch

import hvd.torch as hvd
from hvd import elastic
from horovod.torch.elastic import TorchState  # Horovod's import path

if hvd.elastic.TorchState is not TorchState:  # (hvd.torch.elastic: hvd.elastic)
    raise SystemExit("hvd.torch.elastic.TorchState is not horovod.torch.elastic.TorchState")


def fail(message):
    print("rank {}: {}".format(hvd.rank(), message), file=sys.stderr)
    sys.exit(1)


hvd.init()
r = hvd.rank()


def build(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    return model, opt


def train(model, opt, steps):
    for i in range(steps):
        opt.zero_grad()
        model(torch.full((2, 4), float(r + i))).sum().backward()
        opt.step()


model, opt = build(0)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
state = TorchState(model=model, optimizer=opt, epoch=0)
train(model, opt, 2)
state.epoch = 2
state.commit()
committed = {k: v.clone() for k, v in model.state_dict().items()}
momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
path = state.checkpoint()
if r == 0 and (path is None or not os.path.isfile(os.path.join(path, "torch.pt"))):
    fail("checkpoint() wrote no torch.pt: {!r}".format(path))
train(model, opt, 1)  # live values past the commit: not in the checkpoint

# A new process would start here: a fresh model and optimizer, loaded from the checkpoint on rank 0, then synced.
model2, opt2 = build(1 + r)
fresh = TorchState(model=model2, optimizer=opt2, epoch=0)
if r == 0:
    commit = fresh.load_checkpoint()
    if commit != 1:
        fail("load_checkpoint() returned {!r}, want commit 1".format(commit))
fresh.sync()
if fresh.epoch != 2:
    fail("epoch {} after load and sync".format(fresh.epoch))
for k, v in model2.state_dict().items():
    if not torch.equal(v, committed[k]):
        fail("parameter {} differs from the commit after load and sync".format(k))
for p, m in zip(model2.parameters(), momentum):
    if not torch.equal(opt2.state[p]["momentum_buffer"], m):
        fail("momentum buffer differs from the commit after load and sync")

if r == 0:
    files = fresh._checkpoint_files()

    # Hostile: a torch.pt whose unpickling would create a file (weights_only refuses it; nothing runs).
    marker = os.path.join(os.environ["HVD_CHECKPOINT_DIR"], "..", "pwned-{}".format(os.getpid()))

    class Evil:
        def __reduce__(self):
            return (open, (marker, "w"))

    buf = io.BytesIO()
    torch.save({"model": Evil(), "optimizer": None}, buf)
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    for what, blob in (("code", buf.getvalue()), ("garbage", b"\x80\x04not a torch file")):
        try:
            fresh._checkpoint_load(dict(files, **{"torch.pt": blob}))
        except elastic._Refused as e:
            if "weights_only" not in str(e):
                fail("{}: refused for another reason: {}".format(what, e))
        else:
            fail("a torch.pt of {} was loaded".format(what))
    if os.path.exists(marker):
        fail("loading the hostile torch.pt ran its code")

    # A checkpoint of another model (other shapes): refused, and the state stays at its last commit.
    other = torch.nn.Linear(5, 5)
    buf = io.BytesIO()
    torch.save({"model": other.state_dict(), "optimizer": opt2.state_dict()}, buf)
    fresh.epoch = 7
    try:
        fresh._checkpoint_load(dict(files, **{"torch.pt": buf.getvalue()}))
    except elastic._Refused as e:
        if "does not fit" not in str(e):
            fail("another model: refused for another reason: {}".format(e))
    else:
        fail("a checkpoint of another model was loaded")
    for k, v in model2.state_dict().items():
        if not torch.equal(v, before[k]):
            fail("a refused checkpoint changed parameter {}".format(k))
    if fresh.epoch != 2:
        fail("a refused checkpoint left epoch {} (want the commit's 2)".format(fresh.epoch))

hvd.shutdown()
print("OK rank {}".format(r))
