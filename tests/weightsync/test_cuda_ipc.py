"""CUDA IPC protocol on CPU: the whole REQ/REP exchange of both modes (flat: one request per
update over persistent buffers; bucketed: double buffering, acks), the engine's version or
error coming back, socket reuse, with the CUDA-only calls faked (_ipc_fakes.py) so leaks
and double releases fail the tests. Refusals and timeouts: test_cuda_ipc_failures.py.
"""

from __future__ import annotations

import ctypes
import threading
import time
import warnings
import weakref
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import zmq
from _weightsync_helpers import FakeEngine, assert_same_tensors

from weightsync.transports import WeightSyncError, cuda_ipc_handles, cuda_ipc_receiver
from weightsync.transports.cuda_ipc import CudaIpcReceiver, CudaIpcSender, release_ipc_endpoint

from _ipc_fakes import FakeIpc, _endpoint, _handle, _meta, _model, _serve, _serving, cpu_ipc  # noqa: F401


def test_protocol_on_cpu(cpu_ipc):
    fake = cpu_ipc
    exported, released = fake.exported, fake.released
    endpoint = _endpoint()
    receiver = CudaIpcReceiver(endpoint, timeout_s=10)
    sender = CudaIpcSender(endpoint, flat=False, bucket_bytes=1024, timeout_s=10)
    generator = torch.Generator().manual_seed(0)
    # 256-byte tensors, four to a bucket, and one oversized tensor after the first bucket.
    weights = [(f"layer{i}.weight", torch.randn(8, 8, generator=generator)) for i in range(20)]
    weights.insert(4, ("embed.weight", torch.randn(64, 16, generator=generator)))
    engine = FakeEngine()
    try:
        thread, outcomes = _serving(receiver, engine)
        stats = sender.send(weights)
        thread.join()
        assert outcomes == [1] and stats.engine_version == 1 and stats.num_buckets > 4
        assert_same_tensors(engine.last, weights)
        # Two alternating buffers for regular buckets; the oversized one is the tensor itself.
        embed_ptr = weights[4][1].untyped_storage().data_ptr()
        assert stats.num_buckets == 6 and exported.count(embed_ptr) == 1
        assert len({ptr for ptr in exported if ptr != embed_ptr}) == 2
        assert sender.reserved_bytes == 0

        # The engine rejects the next update part-way: the trainer hears why, and both
        # sides are ready for the update after it.
        # A bucket refused unmapped gives its IPC reference back; the end message has none.
        for failing_engine, expected, refused in (
            (FakeEngine(fail_after=2), "failed on bucket", 1),
            (FakeEngine(fail_after=20), "rejected", 0),
        ):
            released.clear()
            thread, outcomes = _serving(receiver, failing_engine)
            with pytest.raises(WeightSyncError, match=f"{expected}.*fake engine rejects"):
                sender.send(weights)
            thread.join()
            assert isinstance(outcomes[0], ValueError) and len(released) == refused

        thread, outcomes = _serving(receiver, engine)
        assert sender.send(weights[:3]).engine_version == 2
        thread.join()
        assert_same_tensors(engine.last, weights[:3])
    finally:
        sender.close()
        receiver.close()
    fake.assert_balanced()


def test_flat_round_trips_reuse_buffer_and_mapping(cpu_ipc):
    fake = cpu_ipc
    endpoint = _endpoint()
    receiver = CudaIpcReceiver(endpoint, timeout_s=10)
    sender = CudaIpcSender(endpoint, timeout_s=10, zero_copy=False)  # flat is the default; every tensor packed
    engine = FakeEngine()
    # A trainer updates its parameters in place between sends.
    params = _model(0)
    try:
        for step in range(3):
            with torch.no_grad():
                for (_, param), (_, value) in zip(params, _model(step)):
                    param.copy_(value)
            thread, outcomes = _serving(receiver, engine)
            stats = sender.send(iter(params))
            thread.join()
            assert outcomes == [step + 1] and stats.engine_version == step + 1
            assert stats.num_buckets == 1 and stats.num_tensors == len(params)
            assert_same_tensors(engine.last, _model(step))
            if step == 0:
                pack, reserved = sender._pack, sender.reserved_bytes
        # One buffer, exported once, mapped once; the engine staged nothing.
        assert sender._pack is pack and sender.reserved_bytes == reserved > 0
        assert len(fake.exported) == 1 and fake.imported == [0] and fake.released == []
        assert fake.outstanding() == {0: 1}  # the engine still maps it, for the next update
        # Receivers come and go (an engine makes one per update): the mapping stays.
        receiver.close()
        receiver = CudaIpcReceiver(endpoint, timeout_s=10)
        thread, outcomes = _serving(receiver, engine)
        assert sender.send(params).engine_version == 4
        thread.join()
        assert len(fake.exported) == 1 and fake.imported == [0]
        # An empty update is a layout change like any other.
        thread, outcomes = _serving(receiver, engine)
        assert sender.send([]).num_buckets == 0
        thread.join()  # the serving thread records its outcome after the trainer hears back
        assert outcomes == [5] and engine.last == []
        assert fake.outstanding() == {}  # the engine let go of the old buffer
    finally:
        sender.close()
        receiver.close()
    fake.assert_balanced()


def test_zero_copy_exports_parameters_where_they_lie(cpu_ipc):
    """Flat mode's default: contiguous tensors are exported in place, once, and read again in
    place on later sends (the trainer writes them in place); a strided view goes into the
    pack; a tensor the stream makes afresh each send is noticed at its new address and packed
    from the next send on, after which nothing is exported again."""
    fake = cpu_ipc
    endpoint = _endpoint()
    receiver = CudaIpcReceiver(endpoint, timeout_s=10)
    sender = CudaIpcSender(endpoint, timeout_s=10)
    engine = FakeEngine()
    params = _model(0)
    matrix = torch.randn(8, 16)

    def stream(step: int):
        # parameters, a transposed view (strided), and a cast made afresh each call
        return params + [("proj.weight", matrix.t()), ("cast.weight", params[0][1].to(torch.bfloat16))]

    try:
        counts = []
        for step in range(5):
            with torch.no_grad():
                for (_, param), (_, value) in zip(params, _model(step)):
                    param.copy_(value)
                matrix.mul_(2.0)
            weights = stream(step)
            thread, outcomes = _serving(receiver, engine)
            stats = sender.send(weights)
            thread.join()
            assert outcomes == [step + 1]
            # in-place tensors come first, then the packed ones (update_weights takes any order)
            assert_same_tensors(sorted(engine.last, key=lambda item: item[0]), sorted(weights, key=lambda item: item[0]))
            counts.append((stats.num_buckets, len(fake.exported), sender.reserved_bytes > 0))
        n = len(params)
        # send 1: n params + the cast in place, the view packed; send 2: the cast moved, so
        # everything is exported again (the cast still in place this once); send 3 on: the
        # cast is packed beside the view, exported once more, then never again
        assert counts == [(n + 2, n + 2, True), (n + 2, 2 * (n + 2), True)] + [(n + 1, 3 * (n + 2) - 1, True)] * 3
        assert len(set(fake.outstanding())) == n + 1  # the engine maps only the current layout
    finally:
        sender.close()
        receiver.close()
    fake.assert_balanced()


def test_flat_layout_change_reallocates(cpu_ipc):
    fake = cpu_ipc
    endpoint = _endpoint()
    receiver = CudaIpcReceiver(endpoint, timeout_s=10)
    sender = CudaIpcSender(endpoint, timeout_s=10, max_buffer_bytes=1024, zero_copy=False)
    engine = FakeEngine()
    reshaped = [(n, t.reshape(8, 16)) if n == "layers.2.weight" else (n, t) for n, t in _model(1)]
    extended = reshaped + [("lm_head.weight", torch.randn(40, 8))]  # 1280 bytes: a buffer of its own
    try:
        counts = []
        for weights in (_model(0), _model(0), reshaped, reshaped, extended, extended):
            thread, outcomes = _serving(receiver, engine)
            stats = sender.send(weights)
            thread.join()
            assert_same_tensors(engine.last, weights)
            counts.append((stats.num_buckets, len(fake.exported), len(fake.imported)))
            # Only the current buffers stay mapped: the engine dropped the replaced ones.
            assert set(fake.outstanding()) == set(range(len(fake.exported) - stats.num_buckets, len(fake.exported)))
        # 512-byte tensors, two to a 1024-byte buffer: 4 buffers, then 5 with the oversized one.
        assert counts == [(4, 4, 4), (4, 4, 4), (4, 8, 8), (4, 8, 8), (5, 13, 13), (5, 13, 13)]
    finally:
        sender.close()
        receiver.close()
    fake.assert_balanced()


def test_flat_engine_rejection_propagates(cpu_ipc, monkeypatch):
    fake = cpu_ipc
    endpoint = _endpoint()
    receiver = CudaIpcReceiver(endpoint, timeout_s=10)
    sender = CudaIpcSender(endpoint, timeout_s=10, zero_copy=False)
    weights = _model(0)
    try:
        thread, outcomes = _serving(receiver, FakeEngine(fail_after=2))
        with pytest.raises(WeightSyncError, match="rejected the weight update: ValueError: fake engine rejects"):
            sender.send(weights)
        thread.join()
        assert isinstance(outcomes[0], ValueError)
        assert sender.reserved_bytes > 0  # the engine answered, so it is done reading: keep the buffer

        # Refused before mapping (a GPU the engine cannot use): the reference comes back.
        def wrong_gpu(handle, device):
            raise WeightSyncError("the trainer's buffer is on another GPU")

        monkeypatch.setattr(cuda_ipc_handles, "check_flat_device", wrong_gpu)
        thread, outcomes = _serving(receiver, FakeEngine())
        with pytest.raises(WeightSyncError, match="rejected the weight update: WeightSyncError: .*another GPU"):
            sender.send(weights)
        thread.join()
        assert len(fake.released) == 1
        monkeypatch.undo()
        monkeypatch.setattr(cuda_ipc_handles, "export_handle", fake.export)
        monkeypatch.setattr(cuda_ipc_handles, "import_handle", fake.import_)
        monkeypatch.setattr(cuda_ipc_handles, "release_handle", fake.release)
        monkeypatch.setattr(cuda_ipc_handles, "resolve_cuda_device", lambda device: torch.device("cpu"))

        engine = FakeEngine()
        thread, outcomes = _serving(receiver, engine)
        assert sender.send(weights).engine_version == 1
        thread.join()
        assert_same_tensors(engine.last, weights)
        # After each error the trainer exports anew (the engine may or may not have kept
        # the old handle): three exports, each reference given back exactly once.
        assert len(set(fake.exported)) == 1 and len(fake.exported) == 3
        assert fake.outstanding() == {2: 1}
    finally:
        sender.close()
        receiver.close()
    fake.assert_balanced()


def test_trainer_buffer_untouched_while_engine_reads(cpu_ipc):
    fake = cpu_ipc
    endpoint = _endpoint()
    receiver = CudaIpcReceiver(endpoint, timeout_s=10)
    sender = CudaIpcSender(endpoint, timeout_s=10, zero_copy=False)
    seen: list = []

    def slow_apply(stream):
        tensors = list(stream)
        at_start = [(name, tensor.clone()) for name, tensor in tensors]
        time.sleep(0.3 if len(seen) != 1 else 1.0)
        seen.append((at_start, [(name, tensor.clone()) for name, tensor in tensors], time.perf_counter()))
        return len(seen)

    def engine_loop(count: int, outcomes: list) -> None:
        for _ in range(count):
            try:
                outcomes.append(receiver.serve_once(slow_apply))
            except Exception as error:
                outcomes.append(error)

    outcomes: list = []
    thread = threading.Thread(target=engine_loop, args=(3, outcomes))
    thread.start()
    try:
        # Back to back: send() returns only once apply is over, so the next send's copies
        # cannot land under the engine's feet.
        assert sender.send(_model(0)).engine_version == 1
        returned = time.perf_counter()
        assert returned >= seen[0][2]
        # The trainer gives up on an update the engine is still reading: it must never
        # write that buffer again, so the next send packs into a new one.
        sender.timeout_s = 0.3
        with pytest.raises(WeightSyncError, match="did not answer the weight update within 0.3s"):
            sender.send(_model(1))
        assert sender.reserved_bytes == 0
        sender.timeout_s = 10
        assert sender.send(_model(2)).engine_version == 3
        thread.join()
        assert outcomes == [1, 2, 3]
        for (at_start, at_end, _), expected in zip(seen, (_model(0), _model(1), _model(2))):
            assert_same_tensors(at_start, expected)
            assert_same_tensors(at_end, expected)
        assert len(fake.exported) == 2 and len(set(fake.exported)) == 2
    finally:
        thread.join()
        sender.close()
        receiver.close()
    fake.assert_balanced()


def test_switching_to_buckets_unmaps_flat_buffers(cpu_ipc):
    fake = cpu_ipc
    endpoint = _endpoint()
    receiver = CudaIpcReceiver(endpoint, timeout_s=10)
    flat = CudaIpcSender(endpoint, timeout_s=10, zero_copy=False)
    bucketed = CudaIpcSender(endpoint, flat=False, bucket_bytes=1024, timeout_s=10)
    engine = FakeEngine()
    try:
        thread, _ = _serving(receiver, engine)
        flat.send(_model(0))
        thread.join()
        flat.close()
        assert fake.outstanding() == {0: 1}  # closed, but the engine still maps its buffer
        thread, outcomes = _serving(receiver, engine)
        bucketed.send(_model(1))
        thread.join()
        assert outcomes == [2] and fake.outstanding() == {}
        assert_same_tensors(engine.last, _model(1))
    finally:
        bucketed.close()
        receiver.close()
    fake.assert_balanced()


def test_receiver_socket_outlives_receiver(cpu_ipc):
    endpoint = _endpoint()
    sender = CudaIpcSender(endpoint, timeout_s=10)
    engine = FakeEngine()
    try:
        for version in (1, 2, 3):
            # A new receiver per update, as Engine.update_weights_from_ipc makes.
            receiver = CudaIpcReceiver(endpoint, timeout_s=10)
            thread, outcomes = _serving(receiver, engine)
            assert sender.send(_model(version)).engine_version == version
            thread.join()
            receiver.close()
            assert outcomes == [version]
        # The trainer may ask before the engine serves: the request waits at the bound socket.
        result: list = []
        asker = threading.Thread(target=lambda: result.append(sender.send(_model(4))))
        asker.start()
        time.sleep(0.2)
        receiver = CudaIpcReceiver(endpoint, timeout_s=10)
        assert receiver.serve_once(lambda stream: engine.update_weights(stream)) == 4
        asker.join()
        assert result[0].engine_version == 4
        receiver.close(keep_bound=False)
        release_ipc_endpoint(endpoint)
        # Unbound for real: the port is free again (ZMQ closes in the background).
        probe = zmq.Context.instance().socket(zmq.REP)
        try:
            for attempt in range(100):
                try:
                    probe.bind(endpoint)
                    break
                except zmq.ZMQError:
                    time.sleep(0.02)
            else:
                pytest.fail(f"{endpoint} still bound after release_ipc_endpoint()")
        finally:
            probe.close(linger=0)
    finally:
        sender.close()


@pytest.mark.parametrize("zero_copy", [False, True], ids=["packed", "zero-copy"])
def test_engine_updates_from_flat_ipc(cpu_ipc, llama, zero_copy):
    """The real engine path (a new receiver per update, validate everything, then copy into
    the parameters) reading the trainer's flat buffer, or its parameters themselves, in
    place; greedy output follows the trainer's weights, and a bad update is refused whole
    and reported to the trainer."""
    import copy

    from rollout import Engine, EngineConfig, SamplingParams
    from weightsync.trainer import iter_hf_weights

    greedy = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    prompts = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26]]
    engine = Engine(EngineConfig(model=llama.path))
    trainer = copy.deepcopy(llama.hf)
    endpoint = _endpoint()
    sender = CudaIpcSender(endpoint, timeout_s=30, zero_copy=zero_copy)
    num_tensors = len(list(iter_hf_weights(trainer)))

    def hf_greedy(prompt):
        with torch.no_grad():
            out = trainer.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                                   pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        return out[0, len(prompt):].tolist()

    def push(weights) -> tuple:
        """(what the trainer's send() gave, what the engine's update gave)."""
        sent: list = []

        def run():
            try:
                sent.append(sender.send(weights))
            except Exception as error:
                sent.append(error)

        thread = threading.Thread(target=run)
        thread.start()
        try:
            applied = engine.update_weights_from_ipc(endpoint, full=True, timeout_s=30)
        except Exception as error:
            applied = error
        thread.join()
        return sent[0], applied

    try:
        before = [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=greedy)]
        for version, scale in ((1, 1.5), (2, -1.0)):
            with torch.no_grad():
                for name, parameter in trainer.named_parameters():
                    if "norm" not in name:
                        parameter.mul_(scale)
            stats, applied = push(iter_hf_weights(trainer))
            assert applied == stats.engine_version == version
            # packed: one buffer; zero-copy: each parameter is its own buffer, exported once
            # and read in place on the next step too (the trainer wrote it in place)
            assert stats.num_buckets == (num_tensors if zero_copy else 1)
            assert len(cpu_ipc.exported) == stats.num_buckets
            assert (sender.reserved_bytes == 0) == zero_copy
            outputs = [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=greedy)]
            assert outputs == [hf_greedy(prompt) for prompt in prompts]
        assert outputs != before
        bad = [(name, tensor.clone().fill_(float("nan")) if name.endswith("norm.weight") else tensor)
               for name, tensor in iter_hf_weights(trainer)]
        error, refused = push(bad)
        assert isinstance(refused, ValueError) and "non-finite" in str(refused)
        assert isinstance(error, WeightSyncError) and "non-finite" in str(error)
        del error, refused  # their tracebacks hold views of the mapped buffer
        assert [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=greedy)] == outputs
        stats, applied = push(iter_hf_weights(trainer))
        assert applied == stats.engine_version == 3
        assert [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=greedy)] == outputs
        if not zero_copy:
            assert len(cpu_ipc.exported) == 2 and cpu_ipc.imported == [0, 1]  # exported anew after the refusal
        else:
            # the refused update's norms came at new addresses (clones): from then on they
            # are packed (one buffer), the rest still go out where they lie
            norms = sum(name.endswith("norm.weight") for name, _ in iter_hf_weights(trainer))
            assert stats.num_buckets == num_tensors - norms + 1 and sender.reserved_bytes > 0
    finally:
        sender.close()
    cpu_ipc.assert_balanced()


def _child_keeps_a_mapping(marker: str) -> None:
    # An engine process that ends with a flat mapping still cached (no release call).
    raw = (ctypes.c_uint8 * 16)()
    weakref.finalize(raw, Path(marker).write_text, "unmapped")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mapped = torch.frombuffer(raw, dtype=torch.uint8)
    cuda_ipc_receiver._flat_mappings["ipc:///nowhere"] = cuda_ipc_receiver._FlatMappings(mapped={_handle(): mapped})


def test_engine_child_unmaps_at_exit(tmp_path):
    """A spawned child leaves by os._exit (no atexit): its cached mappings must still go,
    or the trainer's buffer stays reserved until the trainer exits."""
    marker = tmp_path / "marker"
    child = mp.get_context("spawn").Process(target=_child_keeps_a_mapping, args=(str(marker),))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 0 and marker.read_text() == "unmapped"
