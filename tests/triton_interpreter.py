"""Triton's interpreter without its repeated language patching and type building: the same computation,
in less time.

A kernel launch in the interpreter (`GridExecutor.__call__`) patches `triton.language` for its kernel
(`_patch_lang`: `inspect.getmembers` over the language's modules, every builtin wrapped) and restores it
when the grid is done. A `@triton.jit` helper called inside the kernel (`InterpretedFunction.__call__`)
patched the language again on every call, although the launch's patch still holds and the helper's
patch finds nothing left to wrap: a third of the GPU-path tests' time, for helpers called in a loop
(the matmuls' dot, attention's splits). Here a helper's call skips the patch when the launch around it
already patched every language module the helper sees. Launches, and anything else, patch as before.
And `_get_np_dtype`, called for every value an op makes, built its table of numpy types on each call:
its answers are kept by element type. And every value an op makes built its type and shape anew
(`_shared_block_types`): they are made once per element type and shape (with it the GPU-path tests
took about 30% less time; the pick's 3,000 draws 57 -> 35 s on a 2-core EPYC). And every integer
add, subtraction and product was done a second time in int64 for an overflow assert that the
interpreter's options switch off: not done. And bfloat16 to float32 and back are a shift of the bits
(a 4-bit matmul's test 21.9 -> 14.4 s with the two).
"""

from __future__ import annotations

import contextlib
import inspect
import threading

_SWAPS: list[tuple[object, str, object, object]] = []  # (owner, attribute, Triton's, ours)


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
    if not all(
        hasattr(interpreter, name) for name in ("_patch_lang", "_get_np_dtype", "GridExecutor", "_LangPatchScope")
    ):
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

    swaps = [
        (interpreter, "_get_np_dtype", _get_np_dtype),
        (interpreter, "_patch_lang", _patch_lang),
        (interpreter.GridExecutor, "__call__", _launch),
    ]
    if "_convert_float" in interpreter.__dict__:
        swaps.append((interpreter, "_convert_float", _bfloat16_conversions(interpreter._convert_float, tl)))
    try:
        from triton.language.semantic import TritonSemantic
    except ImportError:  # an older front end: the language patching's skip alone
        TritonSemantic = None
    core = tl.core  # the types' patches only over the attributes they were written for
    if (
        TritonSemantic is not None
        and "broadcast_impl_value" in TritonSemantic.__dict__
        and core.block_type.__new__ is object.__new__
        and "__init__" in core.block_type.__dict__
        and "__init__" in core.tensor.__dict__
    ):
        swaps += _shared_block_types(core, TritonSemantic)
    if TritonSemantic is not None and "binary_op_sanitize_overflow_impl" in TritonSemantic.__dict__:
        swaps.append(_no_unasserted_overflow_checks(TritonSemantic))
    _SWAPS[:] = [(owner, name, owner.__dict__[name], mine) for owner, name, mine in swaps]
    _use(mine=True)
    interpreter._kvserve_sped_up = True
    return True


def _shared_block_types(core, semantic) -> list[tuple[object, str, object]]:
    """One `block_type` object per (element type, shape), and each tensor's shape and size made once
    per type, instead of anew for every value an op makes (Triton's `tuple` of `constexpr`s and each
    type's name string: a fifth of a launch's time). Then two operands of one type need no broadcast."""
    block_type, tensor, triton_tuple = core.block_type, core.tensor, getattr(core, "tuple", None)
    made: dict = {}
    shapes: dict = {}  # a scalar type's tensor shape and size (a block type keeps its own)
    init, tensor_init, broadcast = block_type.__init__, tensor.__init__, semantic.broadcast_impl_value

    def fresh(cls, *args, **kwargs):  # Triton's: a new object each time (block_type inherits object's
        return object.__new__(cls)  # __new__, which a class whose __new__ was set cannot get back)

    def shared(cls, *args, **kwargs):
        """The one object for a plain (element type, list or Triton tuple of ints); anything else (a
        subclass, a pointer's type, which has no hash, a shape Triton would refuse) a new object whose
        __init__ runs Triton's own, with its checks."""
        if cls is not block_type or len(args) != 2 or kwargs or type(args[1]) not in (list, triton_tuple):
            return object.__new__(cls)
        element_ty, shape = args
        dims = [d.value if isinstance(d, core.constexpr) else d for d in shape]
        if not dims or any(type(d) is not int for d in dims):
            return object.__new__(cls)
        try:
            found = made.get((element_ty, *dims))
        except TypeError:  # an unhashable element type (a pointer)
            return object.__new__(cls)
        if found is None:  # built as Triton builds it, then kept
            found = object.__new__(cls)
            init(found, element_ty, shape)
            made[(element_ty, *dims)] = found
        return found

    def init_once(self, *args, **kwargs):
        if "name" not in self.__dict__:  # a new object (see shared): built here, as Triton builds it
            init(self, *args, **kwargs)

    def tensor_init_shared(self, handle, type):
        block = isinstance(type, block_type)
        try:
            known = type.__dict__.get("_kvserve_tensor_shape") if block else shapes.get(type)
        except TypeError:  # an unhashable scalar type (a pointer)
            known = block = None
        if known is None:
            tensor_init(self, handle, type)
            if block:
                type._kvserve_tensor_shape = self.shape, self.numel
            elif block is False:
                shapes[type] = self.shape, self.numel
            return
        self.handle, self.type, self.dtype = handle, type, type.scalar
        self.shape, self.numel = known

    def broadcast_shared(self, lhs, rhs):
        if lhs.type is rhs.type and isinstance(lhs.type, block_type):  # one shape: nothing to broadcast
            return lhs, rhs
        return broadcast(self, lhs, rhs)

    block_type.__new__ = fresh
    return [
        (block_type, "__new__", shared),
        (block_type, "__init__", init_once),
        (tensor, "__init__", tensor_init_shared),
        (semantic, "broadcast_impl_value", broadcast_shared),
    ]


def _bfloat16_conversions(convert, tl):
    """bfloat16 to float32 and back (rounding toward zero, the interpreter's casts) as a shift of the
    bits, where Triton's `_convert_float` takes each field apart: the same bits, for every value but the
    subnormals, which Triton's takes apart in its own way, so an array holding one goes to Triton's."""
    import numpy as np

    def _convert_float(input, input_dtype, output_dtype, rounding_mode):
        if rounding_mode is None and input.dtype.itemsize == input_dtype.primitive_bitwidth // 8:
            if input_dtype == tl.bfloat16 and output_dtype == tl.float32:
                bits = input.view(np.uint16)
                if not np.any(((bits & 0x7F80) == 0) & ((bits & 0x7F) != 0)):
                    return np.asarray(bits.astype(np.uint32) << 16).reshape(input.shape)
            elif input_dtype == tl.float32 and output_dtype == tl.bfloat16:
                bits = input.view(np.uint32)
                if not np.any(((bits & 0x7F800000) == 0) & ((bits & 0x7FFFFF) != 0)):
                    return np.asarray(bits >> 16).astype(np.uint16).reshape(input.shape)
        return convert(input, input_dtype, output_dtype, rounding_mode)

    return _convert_float


def _no_unasserted_overflow_checks(semantic) -> tuple[object, str, object]:
    """Integer adds, subtractions and products without their overflow check where its assert would do
    nothing. Triton's check (`binary_op_sanitize_overflow_impl`) redoes the op in int64, compares it with
    the type's range and hands the result to `device_assert`, which returns at once unless the options
    ask for debugging; the interpreter's never do. A quarter of a 4-bit matmul's launch went there."""
    check = semantic.binary_op_sanitize_overflow_impl

    def check_when_asserted(self, lhs, rhs, binary_op):
        if getattr(self.builder.options, "debug", True):  # device_assert would assert: Triton's check
            return check(self, lhs, rhs, binary_op)

    return semantic, "binary_op_sanitize_overflow_impl", check_when_asserted


def _use(mine: bool) -> None:
    for owner, name, own, ours in _SWAPS:
        setattr(owner, name, ours if mine else own)


@contextlib.contextmanager
def tritons_own():
    """Triton's interpreter as it ships, for as long as the block runs (for the test that the speed-up
    computes the same)."""
    _use(mine=False)
    try:
        yield
    finally:
        _use(mine=True)
