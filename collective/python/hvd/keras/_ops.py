"""The TensorFlow side of hvd.keras: collectives as TensorFlow ops (``tf.numpy_function`` over hvd's core, so they
run in eager mode, in ``tf.function`` and in TF1 graphs), the gradient reduction of a step as one op, local gradient
aggregation, and the optimizer wrapper."""

import tensorflow as tf

import hvd as _core
from hvd import _compression
import hvd.tensorflow as _hvd_tf

# hvd has no Adasum; a value unlike the five reduce ops, the same as horovod.torch's, so a script may name it and
# get a clear refusal. hvd.tensorflow's own, once it defines one, is the one its users hold.
Adasum = getattr(_hvd_tf, "Adasum", 101)


_CastCompressor = _hvd_tf._CastCompressor


class _FP16Compressor(_CastCompressor):
    dtype = tf.float16


class _BF16Compressor(_CastCompressor):
    dtype = tf.bfloat16


class _Compression:
    """Horovod's ``Compression``: ``none``, ``fp16`` (and ``bf16``), each with ``compress(t) -> (t, ctx)`` and
    ``decompress(t, ctx)``. hvd.tensorflow's own is used when it has one."""

    none = _compression.NoneCompressor
    fp16 = _FP16Compressor
    bf16 = _BF16Compressor


Compression = getattr(_hvd_tf, "Compression", _Compression)


def _set_id_size(process_set):
    if process_set is None or process_set is _core.global_process_set:
        return _core.size()
    size = process_set.size()
    if size is None:
        raise ValueError("{} was not added (hvd.add_process_set)".format(process_set))
    return size


def _reduces_over(process_set):
    """Whether this rank's gradients are reduced over ``process_set``: as in Horovod, a rank outside the set (or a
    set of one rank) keeps its own gradients."""
    if process_set is None or process_set is _core.global_process_set:
        return _core.size() > 1
    return bool(process_set.included()) and _set_id_size(process_set) > 1


def _name(name, default):
    return name if name else default


def _numpy_op(fn, inputs, dtypes, name):
    """Runs ``fn`` on the numpy values of ``inputs``; stateful, so TensorFlow never prunes, reorders across other
    stateful ops or merges it."""
    return tf.numpy_function(fn, inputs, dtypes, stateful=True, name=None if name is None else _op_name(name))


def _op_name(name):
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name).lstrip("._-") or "hvd"


def allreduce_tensor(t, op, name, prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    def run(x):
        return _core.allreduce(x, name=name, op=op, prescale_factor=prescale_factor,
                               postscale_factor=postscale_factor, process_set=process_set).astype(x.dtype, copy=False)

    out = _numpy_op(run, [t], t.dtype, name)
    out.set_shape(t.shape)
    return out


def allgather_tensor(t, name, process_set=None):
    def run(x):
        return _core.allgather(x, name=name, process_set=process_set)

    out = _numpy_op(run, [t], t.dtype, name)
    out.set_shape(tf.TensorShape([None]).concatenate(t.shape[1:]) if t.shape.rank else t.shape)
    return out


def broadcast_tensor(t, root_rank, name, process_set=None):
    def run(x):
        return _core.broadcast(x, root_rank, name=name, process_set=process_set)

    out = _numpy_op(run, [t], t.dtype, name)
    out.set_shape(t.shape)
    return out


def reducescatter_tensor(t, name, op, process_set=None):
    def run(x):
        return _core.reducescatter(x, name=name, op=op, process_set=process_set)

    out = _numpy_op(run, [t], t.dtype, name)
    out.set_shape(tf.TensorShape([None]).concatenate(t.shape[1:]) if t.shape.rank else t.shape)
    return out


def alltoall_tensor(t, splits, name, process_set=None):
    if splits is not None:
        splits = [int(s) for s in (splits.numpy() if hasattr(splits, "numpy") else splits)]

    def run(x):
        return _core.alltoall(x, splits, name=name, process_set=process_set)

    out = _numpy_op(run, [t], t.dtype, name)
    out.set_shape(tf.TensorShape([None]).concatenate(t.shape[1:]) if t.shape.rank else t.shape)
    return out


def broadcast_variables_op(variables, root_rank, name):
    """One op (graph mode) that assigns ``root_rank``'s values to ``variables``."""
    variables = list(variables)
    if not variables:
        return tf.no_op()
    values = [v.read_value() if hasattr(v, "read_value") else tf.convert_to_tensor(v) for v in variables]

    def run(*arrays):
        handles = [_core.broadcast_async(a, root_rank, name="{}.{}".format(name, i)) for i, a in enumerate(arrays)]
        return [_core.synchronize(h) for h in handles]

    out = _as_list(tf.numpy_function(run, values, [v.dtype for v in values], stateful=True))
    return tf.group(*[v.assign(o) for v, o in zip(variables, out)])


def broadcast_variables(variables, root_rank, name="broadcast_variables", process_set=None):
    """Assigns ``root_rank``'s values to ``variables`` (eager): every broadcast submitted, then awaited."""
    variables = list(variables)
    handles = [_core.broadcast_async(v.numpy(), root_rank, name="{}.{}".format(name, i), process_set=process_set)
               for i, v in enumerate(variables)]
    for v, h in zip(variables, handles):
        v.assign(_core.synchronize(h).reshape(v.shape))


def _as_list(outputs):
    """``tf.numpy_function``'s outputs as a list (in eager mode one output comes back alone)."""
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


def reduce_gradients(grads, name, op, compression, sparse_as_dense, prescale, postscale, process_set,
                     average_sparse=None):
    """Reduces a step's gradients (None entries stay None) as ONE op: the dense ones in one grouped allreduce, each
    ``tf.IndexedSlices`` (unless ``sparse_as_dense``) as allgathers of its values and indices, whose values are
    divided by the size when ``average_sparse`` (default: ``op`` is Average). One op, so that TensorFlow cannot run
    a step's collectives in a different order on different ranks."""
    dense, dense_at, ctxs = [], [], []
    sparse, sparse_at = [], []
    for i, g in enumerate(grads):
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices):
            if sparse_as_dense:
                g = tf.convert_to_tensor(g)
            else:
                sparse.append(g)
                sparse_at.append(i)
                continue
        c, ctx = compression.compress(g)
        dense.append(c)
        dense_at.append(i)
        ctxs.append(ctx)
    if not dense and not sparse:
        return list(grads)
    n_dense = len(dense)
    size = _set_id_size(process_set)
    if average_sparse is None:
        average_sparse = op == _core.Average

    def run(*arrays):
        handles = []
        if n_dense:
            handles.append(_core.grouped_allreduce_async(list(arrays[:n_dense]), name=name + ".dense", op=op,
                                                         prescale_factor=prescale, postscale_factor=postscale,
                                                         process_set=process_set))
        rest = arrays[n_dense:]
        for j in range(len(rest) // 2):
            handles.append(_core.allgather_async(rest[2 * j], name="{}.sparse.{}.values".format(name, j),
                                                 process_set=process_set))
            handles.append(_core.allgather_async(rest[2 * j + 1], name="{}.sparse.{}.indices".format(name, j),
                                                 process_set=process_set))
        results = [_core.synchronize(h) for h in handles]
        out = list(results[0]) if n_dense else []
        out.extend(results[1:] if n_dense else results)
        return [o.astype(a.dtype, copy=False).reshape(a.shape) for o, a in zip(out[:n_dense], arrays)] + \
            [o.astype(a.dtype, copy=False) for o, a in zip(out[n_dense:], arrays[n_dense:])]

    inputs = list(dense)
    for s in sparse:
        inputs.extend([s.values, s.indices])
    outputs = _as_list(tf.numpy_function(run, inputs, [x.dtype for x in inputs], stateful=True,
                                         name=_op_name(name)))
    result = list(grads)
    for k, i in enumerate(dense_at):
        out = outputs[k]
        out.set_shape(dense[k].shape)
        result[i] = compression.decompress(out, ctxs[k])
    for j, i in enumerate(sparse_at):
        values, indices = outputs[n_dense + 2 * j], outputs[n_dense + 2 * j + 1]
        values.set_shape(tf.TensorShape([None]).concatenate(sparse[j].values.shape[1:]))
        indices.set_shape([None])
        if average_sparse:
            values = values / tf.cast(size, values.dtype)
        result[i] = tf.IndexedSlices(values, indices, sparse[j].dense_shape)
    return result


class Settings:
    """What ``DistributedOptimizer`` was asked for (kept on the wrapper class, so ``from_config`` copies keep it)."""

    def __init__(self, name, compression, sparse_as_dense, gradient_predivide_factor, op, backward_passes_per_step,
                 average_aggregated_gradients, process_set, scale_local_gradients):
        self.name = name
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.gradient_predivide_factor = gradient_predivide_factor
        self.op = op
        self.backward_passes_per_step = backward_passes_per_step
        self.average_aggregated_gradients = average_aggregated_gradients
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients


class LocalAggregation:
    """Sums ``backward_passes_per_step`` steps' gradients in local variables; every that many steps the sums are
    reduced over the ranks (and divided by the count when ``average``), the optimizer applies them and the sums
    start again from zero. ``counter`` is the number of steps summed since the last reduction."""

    def __init__(self, passes, average, sparse_as_dense):
        self.passes = passes
        self.average = average
        self.sparse_as_dense = sparse_as_dense
        self.counter = tf.Variable(0, trainable=False, dtype=tf.int32, name="hvd_aggregation_counter")
        self.sums = {}

    def _sum_variable(self, i, grad, var):
        if i not in self.sums:
            shape = tf.TensorShape(var.shape) if var is not None else grad.shape
            if not shape.is_fully_defined():
                shape = grad.shape
            with tf.init_scope():
                self.sums[i] = tf.Variable(tf.zeros(shape, grad.dtype), trainable=False,
                                           name="hvd_aggregated_gradient_{}".format(i))
        return self.sums[i]

    def compute_gradients(self, grads, variables, reduce):
        summed = []
        for i, (g, v) in enumerate(zip(grads, variables)):
            if isinstance(g, tf.IndexedSlices):
                if not self.sparse_as_dense:
                    raise ValueError("tf.IndexedSlices gradients cannot be aggregated locally: pass "
                                     "sparse_as_dense=True with backward_passes_per_step > 1")
                g = tf.convert_to_tensor(g)
            if g is None:
                summed.append(None)
                continue
            acc = self._sum_variable(i, g, v)
            acc.assign_add(g)
            summed.append(acc.read_value())
        self.counter.assign_add(1)
        present = [i for i, g in enumerate(summed) if g is not None]
        values = [summed[i] for i in present]
        if not values:
            return summed

        def reduce_and_reset():
            full = [None] * len(summed)
            for i, value in zip(present, values):
                full[i] = value
            reduced = reduce(full, variables)
            out = [reduced[i] for i in present]
            if self.average:
                out = [o / tf.cast(self.passes, o.dtype) for o in out]
            with tf.control_dependencies(out):
                resets = [self.counter.assign(0)] + [self.sums[i].assign(tf.zeros_like(self.sums[i]))
                                                      for i in present]
            with tf.control_dependencies(resets):
                return [tf.identity(o) for o in out]

        def keep():
            return [tf.identity(v) for v in values]

        chosen = tf.cond(tf.equal(self.counter, self.passes), reduce_and_reset, keep)
        if not isinstance(chosen, (list, tuple)):
            chosen = [chosen]
        result = [None] * len(summed)
        for i, value in zip(present, chosen):
            result[i] = value
        return result

    def apply_gradients(self, apply, optimizer):
        """Applies on the step that reduced (the counter is back at 0); on the others only counts the step."""

        def applied():
            apply()
            return tf.constant(True)

        def counted():
            optimizer.iterations.assign_add(1)
            return tf.constant(False)

        return tf.cond(tf.equal(self.counter, 0), applied, counted)


def _key(var):
    """A hashable identity of a variable (``tf.Variable.ref()``; Keras 3 variables have no ``ref``)."""
    return var.ref() if hasattr(var, "ref") else id(var)


class _CallableList(list):
    """The optimizer's variables as a list that may also be called (``opt.variables()``, Horovod's callbacks and
    older scripts) where Keras made ``variables`` a property."""

    def __call__(self):
        return self


def optimizer_variables(optimizer):
    """The variables of a Keras optimizer, whether ``variables`` is a method (legacy) or a property (new)."""
    v = optimizer.variables
    return list(v() if callable(v) and not isinstance(v, list) else v)


class _DistributedMixin:
    """The methods a DistributedOptimizer adds to the optimizer's own class (before it in the MRO)."""

    _hvd_settings = None
    _hvd_keras3 = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        s = self._hvd_settings
        self._hvd_name = s.name or "Distributed{}".format(type(self).__name__)
        self._hvd_local_vars = set()
        self._hvd_steps = 0
        self._agg_helper = None
        self._hvd_reduced = False
        if s.backward_passes_per_step > 1:
            self._agg_helper = LocalAggregation(s.backward_passes_per_step, s.average_aggregated_gradients,
                                                s.sparse_as_dense)

    def register_local_var(self, var):
        """Marks ``var`` as local to this rank: its gradient is not reduced (divided by the number of ranks when
        ``scale_local_gradients``)."""
        self._hvd_local_vars.add(_key(var))

    def _hvd_reduce(self, grads, variables):
        s = self._hvd_settings
        grads = list(grads)
        shared = [i for i, v in enumerate(variables) if _key(v) not in self._hvd_local_vars]
        op, prescale, postscale = s.op, 1.0, 1.0
        if s.op == _core.Average and s.gradient_predivide_factor != 1.0:
            size = _set_id_size(s.process_set)
            op, prescale, postscale = _core.Sum, 1.0 / s.gradient_predivide_factor, \
                s.gradient_predivide_factor / size
        if _reduces_over(s.process_set):
            reduced = reduce_gradients([grads[i] for i in shared], self._hvd_name + ".grads", op, s.compression,
                                       s.sparse_as_dense, prescale, postscale, s.process_set,
                                       average_sparse=s.op == _core.Average)
        else:
            reduced = [grads[i] for i in shared]
        out = list(grads)
        for i, g in zip(shared, reduced):
            out[i] = g
        if s.scale_local_gradients and self._hvd_local_vars:
            size = float(_set_id_size(s.process_set))
            for i, (g, v) in enumerate(zip(grads, variables)):
                if g is None or _key(v) not in self._hvd_local_vars:
                    continue
                if isinstance(g, tf.IndexedSlices):
                    out[i] = tf.IndexedSlices(g.values / size, g.indices, g.dense_shape)
                else:
                    out[i] = g / size
        return out

    def _hvd_allreduce(self, grads, variables):
        grads, variables = list(grads), list(variables)
        if self._agg_helper is not None:
            return self._agg_helper.compute_gradients(grads, variables, self._hvd_reduce)
        return self._hvd_reduce(grads, variables)

    def compute_gradients(self, loss, var_list, tape=None):
        return self._compute_gradients(loss, var_list, None, tape)

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        """The optimizer's gradients of ``loss``, reduced over the ranks (``[(gradient, variable)]``)."""
        base = super()
        tape = tf.GradientTape() if tape is None else tape
        if hasattr(base, "_compute_gradients"):
            grads_and_vars = base._compute_gradients(loss, var_list, grad_loss, tape=tape)
        elif hasattr(base, "compute_gradients"):
            grads_and_vars = base.compute_gradients(loss, var_list, tape=tape)
        else:  # Keras 3 optimizers compute no gradients: the tape does
            var_list = list(var_list)
            if callable(loss):
                with tape:
                    loss = loss()
            grads_and_vars = zip(tape.gradient(loss, var_list, output_gradients=grad_loss), var_list)
        grads_and_vars = list(grads_and_vars)
        grads = [g for g, _ in grads_and_vars]
        variables = [v for _, v in grads_and_vars]
        reduced = self._hvd_allreduce(grads, variables)
        # Keras 3's apply_gradients goes through apply(), which reduces what was not reduced here.
        self._hvd_reduced = self._hvd_keras3
        return list(zip(reduced, variables))

    def get_gradients(self, loss, params):
        """The graph-mode path of legacy optimizers: the gradients, reduced."""
        return self._hvd_allreduce(super().get_gradients(loss, params), params)

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        base = super()
        if self._hvd_keras3:
            # Keras 2's flag (Horovod's tests and scripts pass False, as tf.keras's train step did): it only turns
            # off tf.distribute's cross-replica sum, which Keras 3's apply_gradients has no argument for. The
            # reduction across ranks is hvd's either way.
            kwargs.pop("experimental_aggregate_gradients", None)
        if self._agg_helper is None or self._hvd_keras3:
            return base.apply_gradients(grads_and_vars, *args, **kwargs)
        grads_and_vars = list(grads_and_vars)
        return self._agg_helper.apply_gradients(lambda: base.apply_gradients(grads_and_vars, *args, **kwargs),
                                                self)


class _Keras3Mixin:
    """Keras 3: ``model.fit`` computes the gradients with its own tape and calls ``apply_gradients``, which calls
    ``apply``: the gradients are reduced there (unless ``_compute_gradients`` already did)."""

    _hvd_keras3 = True

    def apply(self, grads, trainable_variables=None):
        base = super()
        grads = list(grads)
        variables = list(trainable_variables) if trainable_variables is not None else list(
            self._trainable_variables)
        if self._hvd_reduced:
            self._hvd_reduced = False
        else:
            grads = self._hvd_allreduce(grads, variables)
        if self._agg_helper is None:
            return base.apply(grads, variables)
        if not self.built:
            with tf.init_scope():
                self.build(variables)
        return self._agg_helper.apply_gradients(lambda: base.apply(grads, variables), self)


def _variables_property(cls):
    """Where the optimizer's class makes ``variables`` a property, the wrapper's is a list that may be called."""
    for klass in cls.__mro__:
        attr = klass.__dict__.get("variables")
        if attr is None:
            continue
        if isinstance(attr, property):
            return {"variables": property(lambda self: _CallableList(attr.fget(self)))}
        return {}
    return {}


def wrapper_class(cls, settings):
    """The subclass of the Keras optimizer class ``cls`` (same name) whose gradients are reduced as ``settings``
    say; its ``from_config`` makes a distributed optimizer (what ``load_model`` needs)."""
    namespace = {"_hvd_settings": settings, "__module__": cls.__module__}
    namespace.update(_variables_property(cls))
    keras3 = not any(hasattr(cls, m) for m in ("compute_gradients", "_compute_gradients", "get_gradients"))
    bases = (_Keras3Mixin, _DistributedMixin, cls) if keras3 else (_DistributedMixin, cls)
    return type(cls.__name__, bases, namespace)


def wrap_optimizer(optimizer, settings):
    """A new optimizer of a subclass of ``optimizer``'s class (same name) made from its config, whose gradients are
    reduced as ``settings`` say."""
    cls = type(optimizer)
    if isinstance(optimizer, _DistributedMixin):
        raise ValueError("{} is already a DistributedOptimizer".format(cls.__name__))
    if not hasattr(optimizer, "get_config") or not hasattr(optimizer, "apply_gradients"):
        raise ValueError("DistributedOptimizer wraps a Keras optimizer, not {!r}".format(cls))
    return wrapper_class(cls, settings).from_config(optimizer.get_config())


def load_model(filepath, settings, custom_optimizers, custom_objects, legacy_opts):
    keras = tf.keras
    base = keras.optimizers.legacy.Optimizer if legacy_opts else keras.optimizers.Optimizer
    objects = {}
    for cls in base.__subclasses__():
        if issubclass(cls, _DistributedMixin):
            continue
        objects[cls.__name__] = objects[cls.__name__.lower()] = wrapper_class(cls, settings)
    for cls in custom_optimizers or []:
        objects[cls.__name__] = wrapper_class(cls, settings)
    objects.update(custom_objects or {})
    return keras.models.load_model(filepath, custom_objects=objects)
