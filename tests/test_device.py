"""Host-to-device uploads (rollout/device.py): a step's metadata arrays go to the device in one
copy, each part a view of its own dtype into the one buffer, aligned, empty parts included."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollout.device import ALIGN, pack, unpack, upload


def _arrays() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(-2**40, 2**40, 7, dtype=np.int64), np.arange(5, dtype=np.int32),
            np.zeros(0, dtype=np.int64), rng.integers(0, 2**31, 3, dtype=np.int32),
            rng.standard_normal(4).astype(np.float32), np.array([True, False, True])]


def test_pack_then_unpack_gives_each_array_back_in_its_dtype():
    arrays = _arrays()
    host, offsets = pack(arrays)
    assert all(at % ALIGN == 0 for at in offsets)
    assert offsets == sorted(offsets) and host.numel() >= offsets[-1] + arrays[-1].nbytes
    parts = unpack(host, arrays, offsets)
    for a, t in zip(arrays, parts):
        assert t.dtype == torch.from_numpy(a).dtype and t.shape == a.shape
        assert np.array_equal(t.numpy(), a)
    parts[1][0] = 99  # views of one buffer: parts do not overlap
    assert [np.array_equal(t.numpy(), a) for a, t in zip(arrays, parts)] == [True, False, True, True, True, True]


def test_upload_on_the_cpu_shares_the_arrays():
    arrays = _arrays()
    parts = upload(arrays, torch.device("cpu"))
    for a, t in zip(arrays, parts):
        assert np.array_equal(t.numpy(), a)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the one-copy path is CUDA's")
def test_upload_to_cuda_in_one_copy():
    arrays = _arrays()
    parts = upload(arrays, torch.device("cuda"))
    assert len({t.untyped_storage().data_ptr() for t in parts}) == 1, "one buffer"
    for a, t in zip(arrays, parts):
        assert t.is_cuda and np.array_equal(t.cpu().numpy(), a)
