"""``horovod.runner.util.threads``: Horovod's ``in_thread`` (its test utilities import it)."""

import threading


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    """Runs ``target(*args)`` in a new thread (a daemon by default) and returns the started thread. With ``silent``
    an exception raised by ``target`` is swallowed instead of printed by the thread."""
    if not isinstance(args, tuple):
        raise ValueError("args must be a tuple, not {}; for one argument use (arg,)".format(type(args).__name__))
    run = target
    if silent:
        def run(*a):
            try:
                target(*a)
            except Exception:
                pass
    thread = threading.Thread(target=run, args=args, name=name, daemon=daemon)
    thread.start()
    return thread
