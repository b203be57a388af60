"""The `horovod` compatibility package against its documentation (docs/horovod.md), framework-free: run by
tests/horovod_compat.rs with collective/python on PYTHONPATH; prints `ok` when every check passed."""

import importlib.util
import sys

import horovod

# `import horovod` imports no framework, and neither do the modules that need none.
import horovod.common.exceptions as exceptions
import horovod.common.process_sets as process_sets
import horovod.common.util as util
import horovod.runner
import horovod.runner.launch as launch

for framework in ("torch", "tensorflow", "keras", "jax"):
    assert framework not in sys.modules, framework

import hvd

# Exceptions are hvd's classes: `except HorovodInternalError` catches hvd's lost peer, timeout and stall.
assert exceptions.HorovodInternalError is hvd.HorovodInternalError
for cls in (hvd.PeerLostError, hvd.CollectiveTimeoutError, hvd.StallError):
    assert issubclass(cls, exceptions.HorovodInternalError), cls
assert not issubclass(hvd.MismatchError, exceptions.HorovodInternalError)
assert issubclass(exceptions.HostsUpdatedInterrupt, RuntimeError)
assert exceptions.HostsUpdatedInterrupt(skip_sync=True).skip_sync is True

# horovod.run refuses, naming `hvd run`.
for run in (horovod.run, horovod.runner.run):
    try:
        run(lambda: None, np=2)
    except NotImplementedError as e:
        assert "`hvd run`" in str(e) and "horovodrun" in str(e), e
    else:
        raise AssertionError("horovod.run ran")

# Process sets are hvd's: the global set (id 0) is the whole job; a set of ranks keeps them sorted, refuses what is
# not a rank, and cannot be added before init (a ValueError, as in Horovod); removing a set never added is False.
assert process_sets.ProcessSet is hvd.ProcessSet and process_sets.global_process_set is hvd.global_process_set
assert process_sets.global_process_set.process_set_id == 0
assert process_sets.global_process_set.included()
made = process_sets.ProcessSet([2, 0])
assert made.ranks == [0, 2] and made.process_set_id is None and made.size() is None and made.rank() is None
for bad in ([0, "1"], [True], 3):
    try:
        process_sets.ProcessSet(bad)
    except ValueError:
        pass
    else:
        raise AssertionError("ProcessSet({!r}) was made".format(bad))
try:
    process_sets.add_process_set([0])
except ValueError as e:
    assert "init" in str(e), e
else:
    raise AssertionError("a process set was added before init")
assert process_sets.remove_process_set(made) is False
assert process_sets.remove_process_set(process_sets.global_process_set) is False

# util
assert util.split_list([1, 2, 3, 4, 5], 2) == [[1, 2, 3], [4, 5]]
assert util.num_rank_is_power_2(4) and not util.num_rank_is_power_2(6)
assert util.is_iterable([1]) and not util.is_iterable(3)
assert util.gpu_available("torch") == bool(hvd.cuda_built() or hvd.rocm_built())
with util.env(HOROVOD_CHECK_VALUE=3):
    import os

    assert os.environ["HOROVOD_CHECK_VALUE"] == "3"
assert "HOROVOD_CHECK_VALUE" not in os.environ

# util's version and op helpers, as Horovod's modules call them.
assert util.is_version_greater_equal_than("2.15.0+cu132", "2.3") and not util.is_version_greater_equal_than("1.9", "1.12")
assert util.is_version_greater_equal_than("2.3", "2.3.0")
resolve = util.get_average_backwards_compatibility_fun(hvd)
assert (resolve(None, None), resolve(None, True), resolve(None, False), resolve(hvd.Max, None)) == (
    hvd.Average, hvd.Average, hvd.Sum, hvd.Max)
try:
    resolve(hvd.Sum, True)
except ValueError:
    pass
else:
    raise AssertionError("op and average were both accepted")
assert util.check_installed_version("pytorch", "2.15.0") is None

# horovod.runner.util.threads.in_thread (Horovod's test utilities import it): started, args passed, silent swallows.
from horovod.runner.util.threads import in_thread

got = []
t = in_thread(got.append, ("x",))
t.join()
assert got == ["x"] and t.daemon
in_thread(lambda: 1 / 0, silent=True).join()
try:
    in_thread(got.append, "x")
except ValueError as e:
    assert "tuple" in str(e), e
else:
    raise AssertionError("args that are not a tuple were accepted")

# horovod.runner.common.util.env.get_env_rank_and_size (Horovod's process-set suites call it before init): the first
# launcher pair set (hvd run's, Horovod's names, Open MPI's, PMI's), None without one, an error for half a pair.
import contextlib

from horovod.runner.common.util.env import get_env_rank_and_size


@contextlib.contextmanager
def hvd_env(**values):
    """Sets (a string) or unsets (None) variables for the block, then puts them back."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_PAIR_VARS = ("HVD_RANK", "HVD_SIZE", "HOROVOD_RANK", "HOROVOD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
              "PMI_RANK", "PMI_SIZE")
with hvd_env(**{k: None for k in _PAIR_VARS}):
    assert get_env_rank_and_size() is None
    with hvd_env(PMI_RANK="3", PMI_SIZE="4", OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="2"):
        assert get_env_rank_and_size() == (1, 2)
        with hvd_env(HVD_RANK="0", HVD_SIZE="8"):
            assert get_env_rank_and_size() == (0, 8)
    for half, bad in (({"HOROVOD_RANK": "1"}, "HOROVOD_SIZE"), ({"PMI_SIZE": "2"}, "PMI_RANK"),
                      ({"HVD_RANK": "x", "HVD_SIZE": "2"}, "not numbers")):
        with hvd_env(**half):
            try:
                get_env_rank_and_size()
            except RuntimeError as e:
                assert bad in str(e), e
            else:
                raise AssertionError("{} was accepted".format(half))

# The framework modules are hvd's: without the framework, importing one fails with hvd's own message.
for module, framework, message in (
    ("horovod.torch", "torch", "hvd.torch needs PyTorch"),
    ("horovod.tensorflow", "tensorflow", "hvd.tensorflow needs TensorFlow"),
    ("horovod.tensorflow.keras", "tensorflow", "hvd.tensorflow needs TensorFlow"),
    ("horovod.keras", "tensorflow", "hvd.tensorflow needs TensorFlow"),
    ("horovod.jax", "jax", "hvd.jax needs JAX"),
):
    if importlib.util.find_spec(framework) is not None:
        continue
    try:
        importlib.import_module(module)
    except ImportError as e:
        assert message in str(e), (module, e)
    else:
        raise AssertionError(module + " imported without " + framework)

# The re-export: the first hvd module that exists, every name of it, and a named refusal for what hvd lacks.
from horovod._reexport import reexport

namespace = {"__name__": "horovod.example"}
impl = reexport(namespace, "hvd.not_a_module", "hvd.numpy")
assert impl is sys.modules["hvd.numpy"]
assert namespace["allreduce"] is impl.allreduce and namespace["init"] is hvd.init
try:
    namespace["__getattr__"]("not_in_hvd")
except AttributeError as e:
    assert "'horovod.example' has no attribute 'not_in_hvd'" in str(e) and "docs/horovod.md" in str(e), e
else:
    raise AssertionError("a missing name was found")

try:
    reexport({"__name__": "horovod.example"}, "hvd.not_a_module", "hvd.nor_this", missing="hvd has no example")
except ModuleNotFoundError as e:
    assert str(e) == "hvd has no example", e
else:
    raise AssertionError("a missing module was found")

from horovod._reexport import reexport_elastic

try:
    reexport_elastic({"__name__": "horovod.numpy.elastic"}, "numpy")
except ModuleNotFoundError as e:
    assert "horovod.numpy.elastic needs hvd's elastic training" in str(e), e
else:
    assert importlib.util.find_spec("hvd.elastic") is not None, "found an elastic module hvd does not have"

# horovodrun's flags -> `hvd run`'s options.
cases = [
    (["-np", "2", "python", "t.py", "-np", "3"], ["--workers", "2"], ["python", "t.py", "-np", "3"]),
    (["-np", "2", "-H", "localhost:2", "--gloo", "python", "t.py"], ["--workers", "2"], ["python", "t.py"]),
    (["--num-proc=4", "-H", "a:2,b:2", "python", "t.py"],
     ["--workers", "4", "--engine", "ssh", "--hosts", "a:2,b:2"], ["python", "t.py"]),
    (["-np", "4", "--hostfile", "hosts", "--mpi", "--verbose", "python", "t.py"],
     ["--workers", "4", "--engine", "mpi", "--hostfile", "hosts", "-v"], ["python", "t.py"]),
    (["-np", "2", "--timeline-filename", "tl.json", "-p", "2222", "--", "python", "-u", "t.py"],
     ["--workers", "2", "--ssh-port", "2222", "--timeline", "tl.json"], ["python", "-u", "t.py"]),
    # Elastic: starts -np (else --max-np) workers and goes on down to --min-np.
    (["-np", "4", "--min-np", "2", "--max-np", "8", "--elastic-timeout", "30", "python", "t.py"],
     ["--workers", "4", "--min-workers", "2", "--max-workers", "4", "--elastic-timeout", "30"], ["python", "t.py"]),
    (["--min-np=1", "--max-np=3", "python", "t.py"],
     ["--workers", "3", "--min-workers", "1", "--max-workers", "3"], ["python", "t.py"]),
    # --host-discovery-script: the script's slots start the step, up to --max-np, down to --min-np (else -np).
    (["--host-discovery-script", "d.sh", "--min-np", "1", "--max-np", "4", "python", "t.py"],
     ["--workers", "4", "--min-workers", "1", "--max-workers", "4", "--host-discovery-script",
      os.path.abspath("d.sh")], ["python", "t.py"]),
    (["-np", "2", "--max-np", "8", "--host-discovery-script", "d.sh", "python", "t.py"],
     ["--workers", "8", "--min-workers", "2", "--max-workers", "8", "--host-discovery-script",
      os.path.abspath("d.sh")], ["python", "t.py"]),
    (["-np", "2", "--host-discovery-script=d.sh", "python", "t.py"],
     ["--workers", "2", "--min-workers", "2", "--max-workers", "2", "--host-discovery-script",
      os.path.abspath("d.sh")], ["python", "t.py"]),
    # --slots-per-host (or argparse's prefix `--slots`): the slots of a host the discovery script names alone;
    # --blacklist-cooldown-range MIN MAX: the blacklist's cooldown, as two words.
    (["-np", "2", "--max-np", "4", "--host-discovery-script", "d.sh", "--slots-per-host", "2",
      "--blacklist-cooldown-range", "10", "120", "python", "t.py"],
     ["--workers", "4", "--min-workers", "2", "--max-workers", "4", "--host-discovery-script",
      os.path.abspath("d.sh"), "--slots-per-host", "2", "--blacklist-cooldown-range", "10", "120"], ["python", "t.py"]),
    (["--slots=3", "--host-discovery-script", "d.sh", "--max-np", "4", "python", "t.py"],
     ["--workers", "4", "--min-workers", "4", "--max-workers", "4", "--host-discovery-script",
      os.path.abspath("d.sh"), "--slots-per-host", "3"], ["python", "t.py"]),
    # Without a discovery script Horovod ignores --slots-per-host; the cooldown applies to replacements too.
    (["-np", "4", "--min-np", "2", "--slots-per-host", "2", "--blacklist-cooldown-range", "5", "5", "python", "t.py"],
     ["--workers", "4", "--min-workers", "2", "--max-workers", "4", "--blacklist-cooldown-range", "5", "5"],
     ["python", "t.py"]),
    # --reset-limit: each worker's HVD_ELASTIC_RESET_LIMIT, in the command every engine runs.
    (["-np", "2", "--min-np", "1", "--reset-limit", "3", "python", "t.py"],
     ["--workers", "2", "--min-workers", "1", "--max-workers", "2"],
     ["env", "HVD_ELASTIC_RESET_LIMIT=3", "python", "t.py"]),
]
for argv, options, command in cases:
    assert launch.translate(argv) == (options, command), (argv, launch.translate(argv))

for argv, part in (
    (["--min-np", "3", "-np", "2", "python", "t.py"], "--min-np 3 is above the 2 workers it starts"),
    (["--max-np", "1", "-np", "2", "python", "t.py"], "--max-np 1 is below -np 2"),
    (["--min-np", "x", "-np", "2", "python", "t.py"], "--min-np takes a positive number of workers, not `x`"),
    (["-np", "\u00b2", "python", "t.py"], "-np takes a positive number of workers"),
    (["-np", "2", "--slots-per-host", "0", "python", "t.py"], "--slots-per-host takes a positive number of slots"),
    (["-np", "2", "--blacklist-cooldown-range", "60", "python", "t.py"],
     "--blacklist-cooldown-range takes two whole numbers of seconds (MIN MAX), not `60 python`"),
    (["-np", "2", "--blacklist-cooldown-range", "60"], "`--blacklist-cooldown-range` needs two values"),
    (["-np", "2", "--blacklist-cooldown-range=60", "300", "python"], "`--blacklist-cooldown-range` needs two values"),
    (["-np", "2", "--cooldown-range", "1", "2", "python"], "unknown or unsupported flag `--cooldown-range`"),
    (["--host-discovery-script", "d.sh", "python", "t.py"], "--host-discovery-script needs --max-np (or -np)"),
    (["--host-discovery-script", "d.sh", "--min-np", "3", "--max-np", "2", "python", "t.py"],
     "--min-np 3 is above --max-np 2"),
    (["-np", "2", "--reset-limit", "-1", "python", "t.py"], "--reset-limit takes a non-negative number of resets"),
    (["-np", "2", "--fusion-threshold-mb", "32", "python", "t.py"], "unknown or unsupported flag `--fusion-threshold-mb`"),
    (["python", "t.py"], "-np N (the number of workers) is required"),
    (["-np", "0", "python"], "positive number of workers"),
    (["-np", "2"], "no command to run"),
):
    try:
        launch.translate(argv)
    except launch.UsageError as e:
        assert part in str(e), (argv, e)
    else:
        raise AssertionError("accepted: {}".format(argv))

# `--check-build` is horovodrun's only when it comes before the command.
assert launch.parse(["--check-build"]) == ({}, {"--check-build"}, [])
assert "--check-build" not in launch.parse(["-np", "2", "python", "t.py", "--check-build"])[1]

# The generated file runs the command, quoted, in the caller's directory.
text = launch.hvd_file(["python", "-c", 'print("$HOME")'], "2", "/tmp/a b")
assert "workers = 2" in text, text
assert 'run = "cd \'/tmp/a b\' && exec python -c \'print(\\"\\$HOME\\")\'"' in text, text

# The learning-rate arithmetic of the Keras callbacks (hvd._lr_schedule; the callbacks need Keras, this does not).
from hvd import _lr_schedule as lrs

decay = lrs.schedule_multiplier(0.1, 5)
assert abs(decay(5) - 1.0) < 1e-12 and abs(decay(7) - 0.01) < 1e-12
linear = lrs.schedule_multiplier(lambda epoch: epoch, 15)
assert linear(17) == 17
assert lrs.in_schedule(5, 5, 10) and not lrs.in_schedule(10, 5, 10) and lrs.in_schedule(99, 15, None)
assert not lrs.in_schedule(4, 5, None)
assert lrs.schedule_epoch(3, 0, True, None) == 3 and lrs.schedule_epoch(3, 1, True, None) is None
assert lrs.schedule_epoch(3, 2, False, 8) == 3.25
try:
    lrs.schedule_epoch(3, 2, False, None)
except ValueError:
    pass
else:
    raise AssertionError("a smooth schedule without steps_per_epoch was accepted")
# Warmup on 4 ranks over 2 epochs of 10 batches: 1/4 of the rate at the start (one batch in), the full rate at the
# end of the last warmup epoch; 1 rank has nothing to warm up.
assert abs(lrs.warmup_multiplier(-0.1, 4, 2, 10) - 0.25) < 1e-12
assert abs(lrs.warmup_multiplier(1.9, 4, 2, 10) - 1.0) < 1e-12
assert abs(lrs.warmup_multiplier(0.9, 4, 2, 10) - 0.625) < 1e-12
assert lrs.warmup_multiplier(0.5, 1, 2, 10) == 1.0
assert lrs.steps_per_epoch_of({"steps": 7}, "cb") == 7
assert lrs.steps_per_epoch_of({"samples": 100, "batch_size": 32}, "cb") == 3
try:
    lrs.steps_per_epoch_of({}, "LearningRateWarmupCallback")
except ValueError as e:
    assert "steps_per_epoch" in str(e) and "LearningRateWarmupCallback" in str(e), e
else:
    raise AssertionError("no steps per epoch was accepted")

print("ok")
