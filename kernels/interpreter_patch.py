"""Small fixes for running the kernels under Triton's CPU interpreter (TRITON_INTERPRET=1).

Triton 3.6's interpreter turns a scalar tensor into a Python int with
``int(ndarray_of_shape_(1,))``, which numpy >= 2.3 refuses; that breaks every
``for i in range(lo, hi)`` whose bounds are loaded from memory.  We re-patch
``__index__`` to take the single element.

Its ``tl.dot`` is ``np.matmul``, whose summation order is the host BLAS's
choice: OpenBLAS picks its kernels by CPU (and, within one CPU, by the
operands' shapes and strides), so a bit-for-bit claim that held on one machine
failed on another.  Our ``tl.dot`` sums the products in one fixed order of its
own (a pairwise tree over K of exactly rounded elementwise operations), the
same on every host; :func:`fixed_order_matmul` is that order, and tests can
sum sequentially instead to show that their bit-exact checks notice an order change.  The
interpreter also multiplied bfloat16 operands of ``tl.dot`` as their raw
uint16 bit patterns (its numpy stand-in type for bf16); we widen them to
float32 first.
And its float32 -> bfloat16 cast truncates, where the GPU rounds to nearest
even; we round through torch instead.

Speed: the interpreter re-patches ``triton.language`` (an ``inspect.getmembers``
scan of every module and a closure per builtin) at each kernel launch *and* at
each call of a ``@triton.jit`` helper inside a kernel, which took about a third
of the kernel tests' time.  We patch once per launch (both ``tl`` and
``tl.core``, whichever the kernel's module names) and let helper calls inside
it run under that patch; the values it sets are the same at every launch (the
builtins' interpreter wrappers, the tensor's and the dtypes' methods), so the
first launch records them and later launches set them again without the scan.
Every integer add, sub and mul also built an overflow check (both operands cast
to int64, the op again, two compares and an and: about a third of the rest) for
``device_assert``, which drops it unless the interpreter's options ask for debug
(they never do): we build it only then.  The numpy dtype of a Triton type,
rebuilt as a dict of twenty entries per call, is looked up once per type.  Every
op's result built its block type and its tensor's shape afresh (validated,
unwrapped, wrapped again in ``constexpr``s, a ``tl.tuple`` typed element by
element), and every binary op compared the two shapes element by element to
broadcast them: a shape seen before reuses what was built for it (shapes are
never mutated: only the compiler's code generator sets a ``tl.tuple``'s item),
and operands of one shape skip the broadcast.  Together these took a third of
what the overflow checks left.
Nothing happens on a real GPU.  No kernel module imports this: whoever runs kernels
under the interpreter applies it (tests/conftest.py, the CPU benchmarks, and the
executor's backend choice for ``kernels: triton`` on the CPU).
"""

from __future__ import annotations

import os


def patch_interpreter() -> None:
    """Apply the fixes when TRITON_INTERPRET is set (idempotent; a no-op otherwise)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True"):
        return
    try:
        import triton.runtime.interpreter as interp
    except Exception:  # pragma: no cover - triton missing or changed
        return
    orig = getattr(interp, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_forerun_patched", False):
        return

    def _patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _patched._forerun_patched = True
    interp._patch_lang_tensor = _patched

    builder = getattr(interp, "InterpreterBuilder", None)
    if getattr(builder, "create_dot", None) is not None:
        import numpy as np
        import triton.language as tl

        def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
            def operand(x):
                if x.dtype.scalar == tl.bfloat16:
                    return interp._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
                if x.dtype.primitive_bitwidth == 8 and x.dtype.is_floating():
                    return interp._convert_float(x.data, x.dtype, tl.float16, None).view(np.float16)
                return x.data

            acc = fixed_order_matmul(operand(a), operand(b), d.data.dtype)
            return interp.TensorHandle(acc + d.data, d.dtype.scalar)

        builder.create_dot = _create_dot

    _patch_once_per_launch(interp)
    _sanitize_overflow_only_when_checked(interp)
    _cache_numpy_dtypes(interp)
    _reuse_block_shapes(interp)

    orig_cast = getattr(builder, "cast_impl", None)
    if orig_cast is not None:
        import numpy as np
        import torch
        import triton.language as tl

        def _cast_impl(self, src, dst_type):
            if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
                t = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
                data = t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
                return interp.TensorHandle(data, dst_type.scalar)
            return orig_cast(self, src, dst_type)

        builder.cast_impl = _cast_impl


def fixed_order_matmul(a, b, dtype, sequential: bool = False):
    """``a @ b`` (numpy, ``[..., M, K] @ [..., K, N]``) in ``dtype``, summed in a fixed order: every product
    rounded once, then a pairwise tree over K (k with k + K/2, and so on).  Each output element depends on its own
    row and column alone, whatever the host's BLAS, the shapes or the strides.  ``sequential`` sums k = 0, 1, ...
    one after another instead: another order, for tests that show a bit-exact check notices an order change."""
    import numpy as np

    a, b = np.asarray(a).astype(dtype, copy=False), np.asarray(b).astype(dtype, copy=False)
    terms = a[..., :, :, None] * b[..., None, :, :]  # [..., M, K, N]
    if sequential:
        acc = terms[..., 0, :].copy()
        for k in range(1, terms.shape[-2]):
            acc += terms[..., k, :]
        return acc
    while terms.shape[-2] > 1:
        half = terms.shape[-2] // 2
        pairs = terms[..., :half, :] + terms[..., half:2 * half, :]
        terms = pairs if terms.shape[-2] % 2 == 0 else np.concatenate([pairs, terms[..., 2 * half:, :]], axis=-2)
    return terms[..., 0, :]


def _patch_once_per_launch(interp) -> None:
    """A launch patches the language once; a helper called inside it finds it patched (see the module doc)."""
    orig_patch_lang, scope_type = getattr(interp, "_patch_lang", None), getattr(interp, "_LangPatchScope", None)
    if orig_patch_lang is None or scope_type is None:
        return
    import types

    import triton.language as tl

    every_lang = types.SimpleNamespace(__globals__={"tl": tl, "core": tl.core})
    inside = [False]  # a launch's patch is in place (the interpreter runs one launch at a time)
    patched: list = []  # (object, attribute, the interpreter's value) as the first launch set them

    def _patch_lang(fn):
        if inside[0]:
            return scope_type()  # a helper's call: nothing to patch, nothing to restore
        if patched:  # what the first launch set (recorded where the interpreter's scope lists its changes)
            scope = scope_type()
            for obj, name, value in patched:
                scope.set_attr(obj, name, value)
        else:
            scope = orig_patch_lang(every_lang)
            patched[:] = [(obj, name, vars(obj)[name]) for obj, name, _ in getattr(scope, "_changes", ())]
        inside[0] = True
        restore = scope.restore

        def restore_and_leave():
            inside[0] = False
            restore()

        scope.restore = restore_and_leave
        return scope

    interp._patch_lang = _patch_lang


def _sanitize_overflow_only_when_checked(interp) -> None:
    """Build an integer op's overflow check only where it is asserted (see the module doc)."""
    semantic = getattr(interp, "interpreter_semantic", None)
    sanitize = getattr(type(semantic), "binary_op_sanitize_overflow_impl", None)
    if sanitize is None:
        return

    def _sanitize(lhs, rhs, binary_op):
        if semantic.builder.options.debug:
            sanitize(semantic, lhs, rhs, binary_op)

    semantic.binary_op_sanitize_overflow_impl = _sanitize


def _cache_numpy_dtypes(interp) -> None:
    """The interpreter's numpy dtype of a Triton type, looked up once per type (see the module doc)."""
    orig = getattr(interp, "_get_np_dtype", None)
    if orig is None:
        return
    cache = {}

    def _get_np_dtype(tt_dtype):
        try:
            return cache[tt_dtype.scalar.name]
        except KeyError:
            return cache.setdefault(tt_dtype.scalar.name, orig(tt_dtype))

    interp._get_np_dtype = _get_np_dtype


def _reuse_block_shapes(interp) -> None:
    """Block types and tensor shapes built once per shape; operands of one shape not broadcast (see the module
    doc).  Each replacement falls back to Triton's own code for anything but a shape of plain ints."""
    import builtins
    import math

    import triton.language as tl

    core, semantic = tl.core, getattr(interp, "interpreter_semantic", None)
    tl_tuple, constexpr, block_type, tensor = core.tuple, core.constexpr, core.block_type, core.tensor
    broadcast = getattr(type(semantic), "broadcast_impl_value", None)
    if broadcast is None or not all(hasattr(t, "__init__") for t in (tl_tuple, block_type, tensor)):
        return
    block_init, types, shapes = block_type.__init__, {}, {}

    def _block_type_init(self, element_ty, shape):
        dims = shape.values if type(shape) is tl_tuple else shape if type(shape) is list else None
        key = builtins.tuple(dims) if dims is not None and all(type(d) is int for d in dims) else None
        known = types.get(key)
        if known is None:
            block_init(self, element_ty, shape)  # validates the shape
            if key is not None:
                types[key] = (self.shape, self.numel, str(self.shape))
            return
        self.element_ty = element_ty
        self.shape, self.numel, name = known
        self.name = f"<{name}, {element_ty}>"

    def _tensor_init(self, handle, type):
        self.handle, self.type, self.dtype = handle, type, type.scalar
        if not type.is_block():
            self.numel, self.shape = constexpr(1), tl_tuple([])
            return
        dims = builtins.tuple(type.shape.values if builtins.type(type.shape) is tl_tuple else type.shape)
        known = shapes.get(dims)
        if known is None:
            known = shapes[dims] = (constexpr(math.prod(dims)), tl_tuple([constexpr(d) for d in dims]))
        self.numel, self.shape = known

    def _broadcast(lhs, rhs):
        a, b = lhs.type, rhs.type
        if a.is_block() and b.is_block() and a.shape.values == b.shape.values:
            return lhs, rhs
        return broadcast(semantic, lhs, rhs)

    block_type.__init__ = _block_type_init
    tensor.__init__ = _tensor_init
    semantic.broadcast_impl_value = _broadcast
