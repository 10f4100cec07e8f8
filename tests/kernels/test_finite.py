"""The multi-tensor finiteness kernel (rollout/kernels/finite.py) against torch's own test,
and `kernels.first_non_finite` through it and through the torch path.

On CPU the kernel runs under TRITON_INTERPRET=1 (CPU tensors' addresses work there as on a
GPU); CHUNK is shrunk so that small tensors still span several programs, which is where a
wrong chunk-to-tensor mapping would show.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import
pytest.importorskip("triton", reason="triton is not installed")

from rollout.kernels import finite  # noqa: E402
from rollout.kernels import first_non_finite  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    if DEVICE == "cpu":
        monkeypatch.setattr(finite, "CHUNK", 2 * finite.BLOCK)


def _reference(tensors: list[torch.Tensor]) -> list[int]:
    return [int(not bool(t.isfinite().all())) for t in tensors]


@pytest.mark.parametrize("dtype", DTYPES)
def test_flags_match_torch_at_every_kind_of_position(dtype):
    gen = torch.Generator().manual_seed(0)
    sizes = [1, 7, finite.BLOCK - 1, finite.BLOCK + 1, 3 * 2 * finite.BLOCK + 5, 0, 64]
    values = [float("nan"), float("inf"), float("-inf")]
    for trial in range(6):
        tensors = [torch.randn(n, generator=gen).to(dtype) for n in sizes]
        for i, t in enumerate(tensors):
            if t.numel() and (i + trial) % 3 == 0:
                # first element, last element, or somewhere in a later chunk
                at = [0, t.numel() - 1, int(torch.randint(t.numel(), (1,), generator=gen))][trial % 3]
                t[at] = values[(i + trial) % 3]
        tensors = [t.to(DEVICE) for t in tensors]
        got = finite.non_finite_flags(tensors).tolist()
        assert got == _reference(tensors)


def test_largest_finite_values_and_subnormals_are_not_flagged():
    for dtype in DTYPES:
        info = torch.finfo(dtype)
        t = torch.tensor([info.max, -info.max, info.tiny, info.tiny / 4, 0.0, -0.0], dtype=dtype, device=DEVICE)
        assert finite.non_finite_flags([t]).tolist() == [0]


def test_non_contiguous_tensors_are_read_as_they_are():
    base = torch.randn(64, 96, device=DEVICE)
    base[5, 40] = float("nan")
    column_view = base.t()[40]  # a strided view holding the NaN
    other = base.t()[41]
    assert finite.non_finite_flags([column_view, other]).tolist() == [1, 0]


def test_unaligned_views_are_read_right():
    # a contiguous view 2 bytes into its storage: the kernel must not assume 16-byte alignment
    base = torch.randn(3 * finite.BLOCK + 3, device=DEVICE).to(torch.bfloat16)
    base[2 * finite.BLOCK + 7] = float("inf")
    view = base[1:]
    assert view.data_ptr() % 16 and finite.non_finite_flags([view, base[: finite.BLOCK]]).tolist() == [1, 0]


def test_mixed_dtypes_or_devices_are_refused():
    with pytest.raises(ValueError, match="one device and dtype"):
        finite.non_finite_flags([torch.zeros(3, device=DEVICE), torch.zeros(3, dtype=torch.float16, device=DEVICE)])
    with pytest.raises(ValueError, match="no tensors"):
        finite.non_finite_flags([])


@pytest.mark.parametrize("through_kernel", [True, False])
def test_first_non_finite_names_the_first_bad_tensor_across_groups(through_kernel):
    # forced on for CPU tensors (the interpreter) or off for CUDA ones (the torch path)
    tensors = [torch.randn(100, device=DEVICE).to(dtype) for dtype in (torch.float32, torch.bfloat16, torch.float32,
                                                                       torch.float16, torch.bfloat16)]
    assert first_non_finite(tensors, through_kernel) is None
    tensors[4][9] = float("inf")
    assert first_non_finite(tensors, through_kernel) == 4
    tensors[2][0] = float("nan")  # a group seen first, an index seen later: the smallest index wins
    assert first_non_finite(tensors, through_kernel) == 2
    tensors[1][99] = float("-inf")
    assert first_non_finite(tensors, through_kernel) == 1


def test_first_non_finite_reaches_the_kernel_without_importing_it_first():
    # kernels.finite is a lazy submodule: the engine's first use must find it by attribute
    import subprocess
    import sys

    # on CPU forced through the interpreter; on a GPU with CUDA tensors, as the engine does
    interpret = "os.environ.setdefault('TRITON_INTERPRET', '1')" if DEVICE == "cpu" else "pass"
    code = (f"import os, torch; {interpret}\n"
            "from rollout.kernels import first_non_finite\n"
            f"print(first_non_finite([torch.zeros(3, device='{DEVICE}'), torch.tensor([1.0, float('nan')], device='{DEVICE}')], "
            f"fused={True if DEVICE == 'cpu' else None}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"
