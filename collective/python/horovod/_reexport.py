"""Fills a ``horovod.*`` module's namespace from the hvd module that implements it."""

import importlib


def _first_importable(candidates, missing):
    """The first of ``candidates`` (module names) that exists; an ImportError raised inside one (a missing
    framework) propagates with hvd's message. When none exists: ModuleNotFoundError(``missing``) if given."""
    for name in candidates:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            if name == candidates[-1]:
                if missing is None:
                    raise
                raise ModuleNotFoundError(missing, name=name) from None
    raise AssertionError("no candidate module")


def reexport(namespace, *candidates, missing=None):
    """Copies every name of the first importable hvd module of ``candidates`` into ``namespace`` (names the module
    defines itself win) and gives it a ``__getattr__`` that names what hvd lacks. Returns the hvd module; when hvd
    has none of them, raises ModuleNotFoundError with the message ``missing``."""
    impl = _first_importable(candidates, missing)
    for key, value in vars(impl).items():
        if not (key.startswith("__") and key.endswith("__")):
            namespace.setdefault(key, value)
    if hasattr(impl, "__all__"):
        namespace.setdefault("__all__", list(impl.__all__))
    module = namespace["__name__"]

    def __getattr__(name):
        try:
            return getattr(impl, name)
        except AttributeError:
            raise AttributeError(
                "module {!r} has no attribute {!r}: hvd ({}) does not implement it; docs/horovod.md lists what "
                "works".format(module, name, impl.__name__)
            ) from None

    namespace["__getattr__"] = __getattr__
    return impl


def reexport_elastic(namespace, framework):
    """``horovod.<framework>.elastic``: hvd's ``hvd.<framework>.elastic``, else ``hvd.elastic``; neither (today):
    ModuleNotFoundError saying that hvd has no elastic training yet."""
    return reexport(
        namespace,
        "hvd.{}.elastic".format(framework),
        "hvd.elastic",
        missing="horovod.{}.elastic needs hvd's elastic training, which hvd does not have yet (`hvd run` has no "
        "elastic mode); docs/horovod.md".format(framework),
    )
