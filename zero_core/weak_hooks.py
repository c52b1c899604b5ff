"""Hooks on parameters that do not keep their engine alive.

A hook registered on a tensor (``register_post_accumulate_grad_hook``) is owned by the tensor's C++ side, which
Python's cycle collector cannot see through. A bound method of the engine registered there makes a cycle the
collector never frees: parameter → hook → engine → parameter. A dropped engine (a notebook that builds a new
one, a benchmark or a sweep that trains several in one process) then keeps its GPU memory until the process
ends. ``weakly(engine.method)`` calls the method while the engine lives and does nothing after;
``weakly(runtime.method, unit)`` also holds the leading argument weakly (a unit holds the parameters, and so
the GPU buffers, that carry the hook).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable


def weakly(method: Callable[..., Any], *leading: Any) -> Callable[..., Any]:
    """``method`` (a bound method) called through a weak reference to its object, with ``leading`` objects
    (held weakly too) before the hook's own arguments; once any of them is gone the call does nothing."""
    if not leading:  # the per-parameter gradient hooks' case: one dereference and a plain call, no bound method
        owner, func = weakref.ref(method.__self__), method.__func__

        def call_method(*args, **kwargs):
            obj = owner()
            return None if obj is None else func(obj, *args, **kwargs)

        return call_method
    ref = weakref.WeakMethod(method)
    leading_refs = [weakref.ref(obj) for obj in leading]

    def call(*args, **kwargs):
        bound, objs = ref(), [r() for r in leading_refs]
        if bound is None or any(obj is None for obj in objs):
            return None
        return bound(*objs, *args, **kwargs)

    return call
