"""Triton's interpreter without its repeated language patching: the same computation, a third less time.

A kernel launch in the interpreter (`GridExecutor.__call__`) patches `triton.language` for its kernel
(`_patch_lang`: `inspect.getmembers` over the language's modules, every builtin wrapped) and restores it
when the grid is done. A `@triton.jit` helper called inside the kernel (`InterpretedFunction.__call__`)
patched the language again on every call, although the launch's patch still holds and the helper's
patch finds nothing left to wrap: a third of the GPU-path tests' time, for helpers called in a loop
(the matmuls' dot, attention's splits). Here a helper's call skips the patch when the launch around it
already patched every language module the helper sees. Launches, and anything else, patch as before.
And `_get_np_dtype`, called for every value an op makes, built its table of numpy types on each call:
its answers are kept by element type.
"""

from __future__ import annotations

import contextlib
import inspect
import threading

_NAMES = ("_patch_lang", "_get_np_dtype")


def speed_up() -> bool:
    """Install the skip once; False (and nothing changed) where Triton's interpreter is not the one
    this was written for (triton 3.x: `_patch_lang` and `GridExecutor`)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    if getattr(interpreter, "_kvserve_sped_up", False):
        return True
    if not all(hasattr(interpreter, name) for name in (*_NAMES, "GridExecutor", "_LangPatchScope")):
        return False

    patch_lang, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    state = threading.local()  # `held`: the language modules the current launch patched (None outside one)

    seen: dict = {}  # a helper's language modules, by function: looked up once, not per call

    def languages(fn) -> set[int]:
        found = seen.get(fn)
        if found is None:
            found = seen[fn] = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        return found

    def _patch_lang(fn):
        held = getattr(state, "held", None)
        if held is None:  # outside a launch: as Triton does
            return patch_lang(fn)
        wanted = languages(fn)
        if wanted and wanted <= held:  # a helper inside the launch: the launch's patch holds
            return interpreter._LangPatchScope()
        scope = patch_lang(fn)
        held |= wanted
        return scope

    def _launch(self, *args, **kwargs):
        outer = getattr(state, "held", None)
        state.held = set()
        try:
            return launch(self, *args, **kwargs)
        finally:
            state.held = outer

    np_dtype, np_dtypes = interpreter._get_np_dtype, {}

    def _get_np_dtype(tt_dtype):
        key = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype  # a block: its element's
        if isinstance(key, tl.pointer_type):  # unhashable; answered at once
            return np_dtype(key)
        found = np_dtypes.get(key)
        if found is None:
            found = np_dtypes[key] = np_dtype(key)
        return found

    interpreter._kvserve_own = {name: getattr(interpreter, name) for name in _NAMES}, launch
    interpreter._get_np_dtype = _get_np_dtype
    interpreter._patch_lang = _patch_lang
    interpreter.GridExecutor.__call__ = _launch
    interpreter._kvserve_sped_up = True
    return True


@contextlib.contextmanager
def tritons_own():
    """Triton's interpreter as it ships, for as long as the block runs (for the test that the speed-up
    computes the same)."""
    from triton.runtime import interpreter

    own, launch = interpreter._kvserve_own
    mine = {name: getattr(interpreter, name) for name in _NAMES}, interpreter.GridExecutor.__call__
    for name, function in own.items():
        setattr(interpreter, name, function)
    interpreter.GridExecutor.__call__ = launch
    try:
        yield
    finally:
        for name, function in mine[0].items():
            setattr(interpreter, name, function)
        interpreter.GridExecutor.__call__ = mine[1]
