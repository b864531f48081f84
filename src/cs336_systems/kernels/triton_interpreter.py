"""Triton's CPU interpreter (TRITON_INTERPRET=1, how CI runs the kernels without a GPU), and a patch for four of
its gaps that our kernels hit. Compiled kernels are unaffected: the patch is applied only when interpreting.

Triton decides at decoration time whether a kernel is compiled or interpreted, so the choice must be made (the
environment variable set) before triton is imported, and `patch()` called before the kernels run.
"""

from __future__ import annotations

import os


def enabled() -> bool:
    """True when Triton kernels run in the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_off_cuda(device) -> None:
    """A CLI's choice: off CUDA our kernels run in the interpreter (unless the environment says otherwise). Call it
    before anything imports triton."""
    if device.type != "cuda":
        os.environ.setdefault("TRITON_INTERPRET", "1")


def patch() -> None:
    """Work around four gaps of the Triton 3.6 interpreter (idempotent):

    - Scalars are 1-element arrays and `range()` calls `int()` on them, an error since NumPy 2.4
      (triton-lang/triton#9171): loop bounds derived from program_id fail. Squeeze first, as upstream's fix does.
    - bfloat16 is stored as uint16 bit patterns and `tl.dot` multiplies those bits (triton-lang/triton#11584).
      Widen bf16 operands to float32 first: exact, since a bf16 x bf16 product fits in float32, which is what the
      GPU's bf16 MMA with float32 accumulation computes.
    - float32 -> bfloat16 (`x.to(tl.bfloat16)`) truncates toward zero, where the GPU rounds to nearest even: a
      bias that AdamW's repeated stores turn into drift. Round to nearest even, as the GPU does.
    - A call of one @triton.jit function from another patches triton.language's builtins for the interpreter and
      never restores them, so they stay patched for the rest of the process: a Gluon kernel compiled later in it
      (the Hopper tier's compile check) gets raw IR values from `gl.num_programs`. Restore them after the call,
      as a kernel launch does.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_cs336_patched", False):
        return
    patch_lang_tensor = interpreter._patch_lang_tensor
    create_dot = interpreter.InterpreterBuilder.create_dot

    def patched_lang_tensor(tensor, scope) -> None:
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    def widen_bf16(x):
        if x.dtype != tl.bfloat16:
            return x
        bits = x.data.astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def patched_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen_bf16(a), widen_bf16(b), d, input_precision, max_num_imprecise_acc)

    create_fp_trunc = interpreter.InterpreterBuilder.create_fp_trunc

    def patched_fp_trunc(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return create_fp_trunc(self, src, dst_type)
        bits = src.data.astype(np.float32).view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        nan = np.isnan(src.data)
        rounded[nan] = (bits[nan] >> 16).astype(np.uint16) | 0x0040  # a NaN stays a (quiet) NaN
        return interpreter.TensorHandle(rounded, tl.bfloat16)

    # InterpretedFunction.__call__ (a call from inside a kernel), with its patch of the language restored
    def device_call(self, *args, **kwargs):
        scope = interpreter._patch_lang(self.fn)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e
        finally:
            scope.restore()

    interpreter.InterpretedFunction.__call__ = device_call
    interpreter._patch_lang_tensor = patched_lang_tensor
    interpreter.InterpreterBuilder.create_dot = patched_dot
    interpreter.InterpreterBuilder.create_fp_trunc = patched_fp_trunc
    interpreter._cs336_patched = True
