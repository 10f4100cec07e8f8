"""The engine process on a CUDA device, driven by RolloutClient, against an in-process Engine
of the same configuration on the same GPU: generate, a weight update over CUDA IPC handles
(the trainer in this process, CudaIpcSender -> client.update_weights_from_ipc), and a
sleep/wake cycle that hands the device memory back to this GPU's other users.

GPU only: CUDA IPC and device memory cannot be exercised on CPU (the CPU twins are
test_client_weights.py and test_client_sleep.py)."""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import make_prompts
from server_fixtures import text_model  # noqa: F401 (fixture)

from rollout import Engine, EngineConfig, SamplingParams
from rollout.distributed.ports import free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA IPC, device memory)"),
]

# a small KV pool: the in-process engine shares this test process with other GPU tests
CONFIG = dict(device="cuda", dtype="float32", enable_lora=False, max_total_tokens=4096)
GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5, ignore_eos=True)


@pytest.fixture(scope="module")
def cuda_pair(text_model):
    from rollout.server import RolloutClient

    client = RolloutClient.launch(text_model.path, server_args=["--log-level", "WARNING"], **CONFIG)
    engine = Engine(EngineConfig(model=text_model.path, **CONFIG))
    yield client, engine
    client.close()
    del engine  # later GPU tests in this process compare torch.cuda.memory_allocated()
    gc.collect()
    torch.cuda.empty_cache()


def _same(got, want) -> None:
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want, strict=True):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
        assert g.weight_version == w.weight_version


def test_generate_on_cuda_equals_in_process(cuda_pair, text_model) -> None:
    client, engine = cuda_pair
    prompts = make_prompts(text_model.vocab_size, [6, 9, 4], seed=70)
    for params in (GREEDY, SAMPLED):
        _same(client.generate(input_ids=prompts, sampling_params=params),
              engine.generate(input_ids=prompts, sampling_params=params))


def test_weight_update_over_cuda_ipc_through_the_client(cuda_pair, text_model) -> None:
    from weightsync.transports.cuda_ipc import CudaIpcSender

    client, engine = cuda_pair
    g = torch.Generator().manual_seed(3)
    state = dict(text_model.hf.state_dict())
    names = ["model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.weight", "lm_head.weight"]
    update = [(n, (state[n] + torch.randn(state[n].shape, generator=g) * 0.5).cuda()) for n in names]
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pending = client.update_weights_from_ipc(endpoint, full=False, wait=False, timeout_s=60)
    sender = CudaIpcSender(endpoint, timeout_s=60)
    try:
        stats = sender.send(update)
    finally:
        sender.close()
    version = pending.result(timeout=60)
    assert version == stats.engine_version == engine.update_weights(update, full=False)
    prompts = make_prompts(text_model.vocab_size, [5, 7], seed=71)
    _same(client.generate(input_ids=prompts, sampling_params=GREEDY),
          engine.generate(input_ids=prompts, sampling_params=GREEDY))


@pytest.mark.whole_gpu  # compares the device's free memory (mem_get_info): another test's allocation moves it
def test_sleep_gives_the_device_memory_back(cuda_pair, text_model) -> None:
    client, _ = cuda_pair
    prompts = make_prompts(text_model.vocab_size, [8, 3], seed=72)
    before = client.generate(input_ids=prompts, sampling_params=SAMPLED)
    torch.cuda.synchronize()
    free_awake, _ = torch.cuda.mem_get_info()
    stats = client.sleep(level=1)
    free_asleep, _ = torch.cuda.mem_get_info()
    released = sum(stats.released_bytes.values())
    # The other process's release shows in the driver's free memory (allocator emptied).
    assert free_asleep - free_awake >= 0.9 * released > 0
    client.wake()
    after = client.generate(input_ids=prompts, sampling_params=SAMPLED)
    assert [o.token_ids for o in after] == [o.token_ids for o in before]
