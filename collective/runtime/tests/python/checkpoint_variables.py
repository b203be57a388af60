"""The framework-free part of ``KerasState``'s and ``TensorFlowState``'s checkpoints (no TensorFlow; one rank,
``HVD_CHECKPOINT_DIR`` set by the test): variable values go into ``model.npz`` / ``optimizer.npz`` /
``variables.npz`` (``hvd.elastic._variables_file``) and come back only when they fit the state's variables
(``_variables_from``: number, shapes, dtypes); hostile archives (pickled object arrays, compressed or foreign
entries, gaps) are refused; a checkpoint with those files goes through ``checkpoint()`` / ``load_checkpoint()``,
and one whose ``model.npz`` was altered after it was written is skipped for an older one."""
import io
import os
import sys
import zipfile

import numpy as np

from hvd import elastic

E = elastic


def fail(message):
    print("rank 0: {}".format(message), file=sys.stderr)
    sys.exit(1)


def refused(what, files, name, like, needle):
    try:
        E._variables_from(files, name, like)
    except E._Refused as e:
        if needle not in str(e):
            fail("{}: refused for another reason: {}".format(what, e))
        return
    fail("{}: not refused".format(what))


values = [np.arange(6, dtype=np.float32).reshape(2, 3), np.array(7, np.int64), np.zeros((0,), np.float64),
          np.array([True, False, True]), np.array([1.5, -2.25], np.float16)]
data = E._variables_file(values)
files = {"model.npz": data}
back = E._variables_from(files, "model.npz", values)
if len(back) != len(values):
    fail("round trip: {} values for {}".format(len(back), len(values)))
for i, (a, b) in enumerate(zip(values, back)):
    if a.dtype != b.dtype or a.shape != b.shape or not np.array_equal(a, b):
        fail("round trip: value {} is {} {} {}, want {} {} {}".format(i, b.dtype, b.shape, b, a.dtype, a.shape, a))
if len(E._variables_from(files, "model.npz", None)) != len(values):
    fail("like=None does not give every value")
if E._variables_from({"optimizer.npz": E._variables_file([])}, "optimizer.npz", []) != []:
    fail("an empty list does not round-trip")

# Values that do not fit the state's variables: refused, naming the file and the variable.
refused("fewer variables", files, "model.npz", values + [np.zeros(1)], "holds 5 variables where this state has 6")
refused("another shape", files, "model.npz", [np.zeros((3, 2), np.float32)] + values[1:],
        "variable 0 is float32 [2, 3]")
refused("another dtype", files, "model.npz", values[:1] + [np.array(7, np.int32)] + values[2:], "variable 1 is int64")
refused("a missing file", files, "optimizer.npz", [], "it has no optimizer.npz")

# Hostile archives.
buf = io.BytesIO()
np.savez(buf, a0=np.zeros(2), a2=np.zeros(2))
refused("a gap", {"model.npz": buf.getvalue()}, "model.npz", None, "does not hold the arrays a0 to a1")
buf = io.BytesIO()
np.savez(buf, a0=np.zeros(2), weights=np.zeros(2))
refused("a foreign entry", {"model.npz": buf.getvalue()}, "model.npz", None, "a name no checkpoint writes")
buf = io.BytesIO()
np.savez_compressed(buf, a0=np.zeros(1000))
refused("a compressed entry", {"model.npz": buf.getvalue()}, "model.npz", None, "compressed")
refused("a compressed entry in optimizer.npz (named as such)", {"optimizer.npz": buf.getvalue()}, "optimizer.npz",
        None, "optimizer.npz holds 'a0.npy' compressed")


def lying(shape, descr="<f4", data=b"\0" * 8, version=(1, 0)):
    """An npz whose a0.npy's header declares ``shape`` over ``data``: numpy would allocate the declared array."""
    npy = io.BytesIO()
    header = {"descr": descr, "fortran_order": False, "shape": shape}
    if version == (1, 0):
        np.lib.format.write_array_header_1_0(npy, header)
    else:
        np.lib.format.write_array_header_2_0(npy, header)
    npy.write(data)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("a0.npy", npy.getvalue())
    return out.getvalue()


# 1.2 TB declared in 8 bytes (a MemoryError, uncaught, before the header was checked); one byte short; negative
# dimensions; a 2.0 header; each refused naming the file and the entry, nothing allocated.
refused("a header declaring 1.2 TB", {"model.npz": lying((3 * 10 ** 11,))}, "model.npz", None,
        "model.npz holds 'a0.npy' declaring float32 [300000000000] (1200000000000 bytes) in 8 bytes of data")
refused("a header declaring one byte more", {"variables.npz": lying((3,), "|u1", b"\0\0")}, "variables.npz", None,
        "variables.npz holds 'a0.npy' declaring uint8 [3] (3 bytes) in 2 bytes of data")
refused("negative dimensions", {"optimizer.npz": lying((-2, -1), "<f4")}, "optimizer.npz", None,
        "optimizer.npz holds 'a0.npy' with the shape [-2, -1]")
refused("a 2.0 header declaring 8 EB", {"model.npz": lying((1 << 60,), "<f8", version=(2, 0))}, "model.npz", None,
        "model.npz holds 'a0.npy' declaring float64")
if len(E._load_arrays(lying((2,)))["a0"]) != 2:
    fail("an entry whose header fits its data does not load")
# KerasState counts the optimizer's variables from the zip's directory, without decoding them.
if E._variables_count({"optimizer.npz": data}, "optimizer.npz") != len(values):
    fail("_variables_count does not count the variables")
try:
    E._variables_count({"optimizer.npz": b"not a zip"}, "optimizer.npz")
except E._Refused as e:
    if "optimizer.npz does not load" not in str(e):
        fail("a broken optimizer.npz is refused for another reason: {}".format(e))
else:
    fail("a broken optimizer.npz was counted")
marker = os.path.join(os.environ["HVD_CHECKPOINT_DIR"], "..", "pwned-{}".format(os.getpid()))


class Evil:
    def __reduce__(self):
        return (open, (marker, "w"))


npy = io.BytesIO()
np.save(npy, np.array([Evil()], dtype=object), allow_pickle=True)
buf = io.BytesIO()
with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as archive:
    archive.writestr("a0.npy", npy.getvalue())
refused("a pickled object array", {"model.npz": buf.getvalue()}, "model.npz", None, "does not load")
if os.path.exists(marker):
    fail("loading a pickled object array ran its code")
try:
    E._variables_file([np.array([object()], dtype=object)])
except TypeError as e:
    if "variable 0" not in str(e):
        fail("an object array is refused for another reason: {}".format(e))
else:
    fail("an object array went into a checkpoint")


class VariablesState(E.ObjectState):
    """What KerasState does with its files, over numpy arrays standing in for the variables."""

    def __init__(self, variables, **kwargs):
        self.variables = variables
        super().__init__(**kwargs)

    def _checkpoint_files(self):
        files = super()._checkpoint_files()
        files["model.npz"] = E._variables_file(self.variables)
        files["optimizer.npz"] = E._variables_file(self.variables[:1])
        files["variables.npz"] = E._variables_file([])
        return files

    def _checkpoint_load(self, files):
        model = E._variables_from(files, "model.npz", self.variables)
        E._variables_from(files, "optimizer.npz", self.variables[:1])
        E._variables_from(files, "variables.npz", [])
        super()._checkpoint_load(files)
        self.variables = model


state = VariablesState([np.full((2, 2), 1.0), np.array([1], np.int32)], epoch=0)
state.commit()
first = state.checkpoint()
state.variables = [np.full((2, 2), 2.0), np.array([2], np.int32)]
state.epoch = 1
state.commit()
second = state.checkpoint()
if not first or not second or not os.path.isfile(os.path.join(second, "model.npz")):
    fail("checkpoint() wrote {!r} and {!r}".format(first, second))

fresh = VariablesState([np.zeros((2, 2)), np.array([0], np.int32)], epoch=0)
if fresh.load_checkpoint() != 2 or fresh.epoch != 1 or not np.array_equal(fresh.variables[0], np.full((2, 2), 2.0)):
    fail("the newest checkpoint did not load: epoch {}, {}".format(fresh.epoch, fresh.variables))

# The same size and another value in model.npz: the manifest's SHA-256 no longer matches, so commit 1 loads.
path = os.path.join(second, "model.npz")
with open(path, "rb") as f:
    blob = bytearray(f.read())
blob[-1] ^= 0xFF
os.chmod(path, 0o600)
with open(path, "wb") as f:
    f.write(bytes(blob))
fresh = VariablesState([np.zeros((2, 2)), np.array([0], np.int32)], epoch=5)
if fresh.load_checkpoint() != 1 or fresh.epoch != 0 or not np.array_equal(fresh.variables[0], np.full((2, 2), 1.0)):
    fail("an altered model.npz was not skipped for the older checkpoint: epoch {}, {}".format(
        fresh.epoch, fresh.variables))

# A state of other shapes: every checkpoint refused, nothing loaded.
other = VariablesState([np.zeros((3, 3)), np.array([0], np.int32)], epoch=9)
if other.load_checkpoint() is not None or other.epoch != 9 or other.variables[0].shape != (3, 3):
    fail("a checkpoint of other shapes was loaded")

print("OK rank 0")
