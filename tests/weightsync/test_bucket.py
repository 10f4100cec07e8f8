from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.bucket import (
    ALIGN_BYTES,
    BucketMeta,
    pack_bucket,
    pack_buckets,
    plan_buckets,
    unpack_bucket,
)
from weightsync.dtypes import SUPPORTED_DTYPE_NAMES, name_to_dtype


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    # reshape(-1) first: a 0-dim tensor cannot be viewed as a different-sized dtype.
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _random_tensor(dtype_name: str, shape: tuple[int, ...], seed: int, transpose: bool) -> torch.Tensor:
    dtype = name_to_dtype(dtype_name)
    generator = torch.Generator().manual_seed(seed)
    numel = 1
    for dim in shape:
        numel *= dim
    if dtype == torch.bool:
        tensor = torch.randint(0, 2, shape, generator=generator).bool()
    else:
        raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=generator)
        tensor = raw.view(dtype).reshape(shape)
    if transpose and tensor.dim() >= 2:
        tensor = tensor.transpose(0, 1)  # non-contiguous source
    return tensor


tensor_specs = st.lists(
    st.tuples(
        st.sampled_from(SUPPORTED_DTYPE_NAMES),
        st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple),
        st.integers(0, 2**31 - 1),
        st.booleans(),
    ),
    min_size=0,
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(specs=tensor_specs, bucket_bytes=st.integers(1, 2048))
def test_round_trip_is_bit_exact_and_ordered(specs, bucket_bytes):
    named = [(f"w{i}", _random_tensor(*spec)) for i, spec in enumerate(specs)]
    buckets = list(pack_buckets(iter(named), bucket_bytes))

    received = []
    for expected_index, (meta, buffer) in enumerate(buckets):
        assert meta.index == expected_index
        assert meta.is_last == (expected_index == len(buckets) - 1)
        assert buffer.dtype == torch.uint8 and buffer.dim() == 1 and buffer.numel() == meta.total_bytes
        if meta.oversized:
            assert len(meta.entries) == 1 and meta.entries[0].nbytes > bucket_bytes
        else:
            assert meta.total_bytes <= bucket_bytes
        for entry in meta.entries:
            assert entry.offset % ALIGN_BYTES == 0
        decoded = BucketMeta.from_json(meta.to_json())
        assert decoded == meta
        assert BucketMeta.from_json(meta.to_json().decode()) == meta
        received.extend(unpack_bucket(decoded, buffer))

    assert [name for name, _ in received] == [name for name, _ in named]
    for (_, got), (_, sent) in zip(received, named):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(_bytes_of(got), _bytes_of(sent))


@settings(max_examples=50, deadline=None)
@given(sizes=st.lists(st.integers(0, 300), min_size=1, max_size=20), bucket_bytes=st.integers(1, 1024))
def test_packing_is_lazy(sizes, bucket_bytes):
    consumed = 0

    def source():
        nonlocal consumed
        for i, size in enumerate(sizes):
            consumed += 1
            yield f"w{i}", torch.zeros(size, dtype=torch.uint8)

    seen = 0
    for meta, _ in plan_buckets(source(), bucket_bytes):
        seen += len(meta.entries)
        # A closed bucket may have pulled the first tensor of the next one (or peeked one
        # past an oversized tensor), never more.
        assert consumed <= seen + 1
    assert seen == len(sizes)


def test_unpack_returns_views_not_copies():
    named = [("a", torch.randn(4, 4)), ("b", torch.randn(3))]
    (meta, buffer), = list(pack_buckets(named, 1 << 20))
    views = unpack_bucket(meta, buffer)
    for _, view in views:
        assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def test_oversized_contiguous_tensor_is_not_copied():
    big = torch.randn(100)
    (meta, buffer), = list(pack_buckets([("big", big)], 16))
    assert meta.oversized and buffer.data_ptr() == big.data_ptr()


def test_pack_into_reusable_buffer():
    named = [("a", torch.randn(5)), ("b", torch.arange(7))]
    (meta, tensors), = list(plan_buckets(named, 4096))
    out = torch.full((4096,), 7, dtype=torch.uint8)
    packed = pack_bucket(meta, tensors, out=out)
    assert packed.data_ptr() == out.data_ptr() and packed.numel() == meta.total_bytes
    for (_, got), (_, sent) in zip(unpack_bucket(meta, packed), named):
        assert torch.equal(got, sent)
    with pytest.raises(ValueError, match="holds 8 bytes"):
        pack_bucket(meta, tensors, out=torch.empty(8, dtype=torch.uint8))


def test_unsupported_dtype_is_named():
    with pytest.raises(ValueError, match=r"weight 'c'.*complex64"):
        list(pack_buckets([("c", torch.zeros(2, dtype=torch.complex64))], 1024))


def test_bad_bucket_size():
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(pack_buckets([("a", torch.zeros(2))], 0))


def test_bad_names_and_values():
    with pytest.raises(TypeError, match="non-empty strings"):
        list(pack_buckets([("", torch.zeros(2))], 1024))
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        list(pack_buckets([("a", [1.0, 2.0])], 1024))
    with pytest.raises(ValueError, match="meta device"):
        list(pack_buckets([("a", torch.empty(2, device="meta"))], 1024))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda raw: raw.pop("entries"), "missing field 'entries'"),
        (lambda raw: raw.update(index=True), "field 'index' must be int"),
        (lambda raw: raw["entries"][0].update(dtype="complex64"), "unknown dtype name 'complex64'"),
        (lambda raw: raw["entries"][0].update(nbytes=3), "does not match shape"),
        (lambda raw: raw["entries"][0].update(offset=4096), "outside the bucket"),
        (lambda raw: raw["entries"][0].update(shape=[2, "x"]), "list of ints"),
    ],
)
def test_malformed_header_is_rejected(mutate, message):
    import json

    (meta, _), = list(pack_buckets([("a", torch.zeros(2, 2))], 1024))
    raw = json.loads(meta.to_json())
    mutate(raw)
    with pytest.raises(ValueError, match=message):
        BucketMeta.from_json(json.dumps(raw))


def test_header_not_json():
    with pytest.raises(ValueError, match="not valid JSON"):
        BucketMeta.from_json(b"\x80\x81")


def test_short_buffer_is_rejected():
    (meta, buffer), = list(pack_buckets([("a", torch.zeros(8))], 1024))
    with pytest.raises(ValueError, match="holds 16 bytes but the header needs 32"):
        unpack_bucket(meta, buffer[:16])
