"""Timelines started and stopped at run time (Horovod's start_timeline/stop_timeline): only what ran in between is
in the file, the file is complete when stop_timeline returns, a second start replaces the first, `{rank}` gives
every rank its own file, and a path that cannot be created is an error."""
import json
import os
import sys

import numpy as np

import hvd

out = os.environ["HVD_TEST_OUT"]
hvd.init()
r, n = hvd.rank(), hvd.size()


def names(path):
    with open(path) as f:
        events = json.load(f)  # complete, valid JSON
    return {e.get("name") for e in events} | {e.get("args", {}).get("name") for e in events}


x = np.ones(1000, np.float32)
hvd.allreduce_(x, name="before")
first = os.path.join(out, "first.json")
hvd.start_timeline(first)
hvd.allreduce_(x, name="during.first")
hvd.grouped_allreduce_([np.ones(600, np.float32) for _ in range(4)], name="group")
# A second start closes the first file and opens another.
second = os.path.join(out, "second.json")
hvd.start_timeline(second, mark_cycles=True)
hvd.allreduce_(x, name="during.second")
hvd.stop_timeline()
hvd.allreduce_(x, name="after")
hvd.stop_timeline()  # nothing to stop: fine
if r == 0:
    got = names(first)
    assert "during.first" in got and "group.0 .. group.3 (4 tensors)" in got, got
    assert "MEMCPY_IN_FUSION_BUFFER" in got and "before" not in got and "during.second" not in got, got
    got = names(second)
    assert "during.second" in got and "CYCLE_START" in got, got
    assert "during.first" not in got and "after" not in got, got
else:
    assert not os.path.exists(os.path.join(out, "first.json.rank{}".format(r)))

# `{rank}`: every rank writes its own.
hvd.start_timeline(os.path.join(out, "each-{rank}.json"))
hvd.allreduce_(x, name="each")
hvd.stop_timeline()
assert "each" in names(os.path.join(out, "each-{}.json".format(r)))

# A path that cannot be created: an error on every rank that would write it, and the engine carries on.
try:
    hvd.start_timeline(os.path.join(out, "missing-dir", "t-{rank}.json"))
    sys.exit("an impossible timeline path was accepted")
except hvd.InvalidArgumentError as e:
    assert "timeline" in str(e), e
y = np.full(3, float(r))
hvd.allreduce_(y, op=hvd.Sum, name="still")
assert y[0] == sum(range(n)), y
hvd.shutdown()
try:
    hvd.start_timeline(os.path.join(out, "late.json"))
    sys.exit("start_timeline after shutdown passed")
except hvd.NotInitializedError:
    pass
print("ok timeline_runtime rank {}".format(r))
