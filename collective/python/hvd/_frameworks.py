"""Imports a framework layer's framework (hvd.torch, hvd.tensorflow, hvd.jax), or says what to install."""

import importlib


def require(module, layer, framework, package, alternative=""):
    """``module`` imported, or an ImportError naming ``layer`` (the hvd module that needs it), the ``framework`` and
    the ``package`` to add to the environment, then ``alternative`` (text that follows)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            "{} needs {}, which is not installed in this environment; add {} to the environment's packages{}".format(
                layer, framework, package, alternative)
        ) from e
