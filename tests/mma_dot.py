"""A tl.dot for Triton's CPU interpreter that reduces every output element over K in order,
whatever the element's position in the tile: what the GPU's MMA instructions do, and what
the deterministic kernels' batch invariance rests on (a row's bits must not depend on which
row of the tile it sits in).

Why the interpreter's own dot will not do: it calls numpy's matmul, and OpenBLAS reduces a
row differently by its position in the matrix (measured: rows 0 and 6 of a 16x16 float32
product, given identical inputs, differ in the last bit). A test of invariance across block
shapes would then fail on CPU for a reason the GPU does not have, or pass by luck.

Use: `use_mma_dot(monkeypatch)` in a test or fixture; a no-op when the kernels run compiled.
"""

from __future__ import annotations

import os

import pytest


def _dot_in_k_order(self, a, b, d, input_precision, max_num_imprecise_acc):
    from triton.runtime.interpreter import TensorHandle

    acc_dtype = d.data.dtype
    x, y = a.data.astype(acc_dtype), b.data.astype(acc_dtype)  # products of bf16/fp16 are exact in fp32
    acc = d.data.copy()  # the accumulator is the reduction's start, as in an MMA chain
    for k in range(x.shape[-1]):
        acc = acc + x[..., :, k : k + 1] * y[..., k : k + 1, :]
    return TensorHandle(acc.astype(acc_dtype), d.dtype.scalar)


def use_mma_dot(monkeypatch: pytest.MonkeyPatch) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", _dot_in_k_order)
