"""KV slots copied in every layer in one launch (rollout/kernels/kv_copy.py) against the torch
form, `buffer[dst] = buffer[src]` per buffer (KVPool.copy_slots' CPU path): under
TRITON_INTERPRET=1 on CPU, on the GPU where there is one. Copies are bit moves, so every
dtype is exact."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import
pytest.importorskip("triton", reason="triton is not installed")

from rollout.cache.kv_pool import KVPool  # noqa: E402
from rollout.kernels import kv_copy  # noqa: E402
from rollout.kernels.options import KernelOptions  # noqa: E402
from ulp_checks import DEVICE  # noqa: E402


def _buffers(n: int, slots: int, heads: int, dim: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n * 31 + heads * dim)
    return [torch.randn(slots, heads, dim, generator=g).to(dtype).to(DEVICE) for _ in range(n)]


def _reference(buffers: list[torch.Tensor], src: list[int], dst: list[int]) -> list[torch.Tensor]:
    out = [b.clone() for b in buffers]
    for b in out:
        b[torch.tensor(dst, device=b.device)] = b[torch.tensor(src, device=b.device)]
    return out


# (src, dst) move lists: a fork's partial page (disjoint), and a tree's accepted path into
# position order, path [0, 2, 5] -> moves 2->1 and 5->2: slot 2 is read, then written by a
# later move (what the in-order copy must get right)
MOVES = [([16, 17, 18, 40], [33, 34, 35, 60]), ([12, 15], [11, 12]), ([3], [9])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,dim", [(2, 3), (3, 512)])  # a width below a power of two; one past a block
@pytest.mark.parametrize("moves", MOVES)
def test_copy_slots_matches_torch(dtype: torch.dtype, heads: int, dim: int, moves: tuple[list[int], list[int]]) -> None:
    src, dst = moves
    buffers = _buffers(5, 64, heads, dim, dtype)
    expected = _reference(buffers, src, dst)
    kv_copy.copy_slots(buffers, torch.tensor(src), torch.tensor(dst))
    for i, (got, want) in enumerate(zip(buffers, expected)):
        assert torch.equal(got, want), f"buffer {i}"


def test_copy_slots_nothing_to_move_and_bad_shapes() -> None:
    buffers = _buffers(2, 8, 1, 4, torch.float32)
    before = [b.clone() for b in buffers]
    kv_copy.copy_slots(buffers, torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64))
    assert all(torch.equal(a, b) for a, b in zip(buffers, before))
    with pytest.raises(ValueError, match="one length"):
        kv_copy.copy_slots(buffers, torch.tensor([1, 2]), torch.tensor([3]))
    with pytest.raises(ValueError, match="one shape"):
        kv_copy.copy_slots([buffers[0], buffers[1][:4]], torch.tensor([1]), torch.tensor([2]))


def test_pool_copy_slots_takes_the_kernel_and_equals_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVPool.copy_slots on the fused path (the kernel) and on the torch path give one result."""
    pools = []
    for fused in (True, False):
        pool = KVPool(3, 2, 4, max_total_tokens=64, page_size=16, dtype=torch.float16, device=DEVICE,
                      options=KernelOptions(fused=fused))
        for layer in range(3):
            g = torch.Generator().manual_seed(layer)
            k, v = (torch.randn(pool.num_slots, 2, 4, generator=g).half().to(DEVICE) for _ in range(2))
            pool.store(layer, torch.arange(pool.num_slots, device=DEVICE), k, v)
        calls = []
        monkeypatch.setattr(kv_copy, "copy_slots", lambda *a, _f=kv_copy.copy_slots: (calls.append(1), _f(*a)))
        pool.copy_slots(torch.tensor([20, 23]), torch.tensor([19, 20]))
        monkeypatch.undo()
        assert len(calls) == (1 if fused else 0)
        pools.append(pool)
    for a, b in zip(pools[0].k_buffers + pools[0].v_buffers, pools[1].k_buffers + pools[1].v_buffers):
        assert torch.equal(a, b)
