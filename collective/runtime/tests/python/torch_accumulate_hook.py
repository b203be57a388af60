"""hvd.torch's DistributedOptimizer on a torch without post-accumulate-grad hooks (torch <= 2.0 has none; on a
newer torch the method is removed first): each gradient is still submitted during backward, as soon as it is
accumulated, including with backward_passes_per_step=2, step after step, and the reduced gradients are the
average over the ranks."""
import gc
import sys

import torch

if hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
    del torch.Tensor.register_post_accumulate_grad_hook

import hvd.torch as hvd


def fail(message):
    print("rank {}: {}".format(hvd.rank(), message), file=sys.stderr)
    sys.exit(1)


hvd.init()
r, n = hvd.rank(), hvd.size()
mean = (n + 1) / 2  # the average over the ranks of r + 1

for passes in (1, 2):
    model = torch.nn.Linear(3, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(), backward_passes_per_step=passes)
    if not all(isinstance(h, tuple) for h in opt._hooks):
        fail("the hooks are not on the gradient accumulators: {!r}".format(opt._hooks))
    for step in range(3):
        gc.collect()  # the accumulator nodes must outlive any collection
        opt.zero_grad()
        for k in range(passes):
            model(torch.full((1, 3), float(r + 1))).sum().backward()
            submitted = len(opt._handles)
            want = 2 if k == passes - 1 else 0
            if submitted != want:
                fail("passes={} step {} backward {}: {} gradients submitted, want {}".format(
                    passes, step, k, submitted, want))
        opt.step()
        if not torch.allclose(model.weight.grad, torch.full((2, 3), mean)):
            fail("passes={} step {}: weight gradient {}".format(passes, step, model.weight.grad))
        if not torch.allclose(model.bias.grad, torch.full((2,), 1.0)):
            fail("passes={} step {}: bias gradient {}".format(passes, step, model.bias.grad))
print("rank {}: ok".format(r))
