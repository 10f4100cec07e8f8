"""Weight updates through RolloutClient: tensors sent as raw frames, a safetensors
directory on the engine's file system; the outputs then equal the in-process engine given
the same update, and carry the new weight version. A bad update is refused (the same
error as in-process) and the old weights keep serving. Every update here goes to both
engines, and the module puts the original weights back at the end."""

from __future__ import annotations

import pytest
import torch
from conftest import make_prompts
from server_fixtures import reference, same_output, server, text_model  # noqa: F401 (fixtures)

from rollout import SamplingParams
from weightsync.trainer import iter_hf_weights
from weightsync.transports.disk import save_safetensors_dir

GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=10, seed=17, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def restore_weights(server, reference, text_model):
    yield
    original = list(iter_hf_weights(text_model.hf))
    assert server.update_weights(original, full=True) == reference.update_weights(original, full=True)


def _perturbed(text_model, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    state = dict(text_model.hf.state_dict())
    names = ["model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.weight", "lm_head.weight"]
    return [(n, state[n] + torch.randn(state[n].shape, generator=g) * 0.5) for n in names]


def _generate_both(server, reference, prompts, params):
    got = server.generate(input_ids=prompts, sampling_params=params)
    want = reference.generate(input_ids=prompts, sampling_params=params)
    for g, w in zip(got, want, strict=True):
        same_output(g, w)
    return got


def test_update_weights_from_tensors_then_outputs_equal_in_process(server, reference, text_model) -> None:
    prompts = make_prompts(text_model.vocab_size, [7, 4], seed=30)
    before = _generate_both(server, reference, prompts, GREEDY)
    update = _perturbed(text_model, seed=1)
    version = server.update_weights(update)
    assert version == reference.update_weights(update) == before[0].weight_version + 1
    after = _generate_both(server, reference, prompts, GREEDY) + _generate_both(server, reference, prompts, SAMPLED)
    assert [o.token_ids for o in after[:2]] != [o.token_ids for o in before], "the update should change the outputs"
    assert all(o.weight_version == version and o.weight_versions == [(version, 0, 10)] for o in after)
    assert server.health().weight_version == version


def test_update_weights_from_disk(server, reference, text_model, tmp_path) -> None:
    save_safetensors_dir(_perturbed(text_model, seed=2), tmp_path / "ckpt")
    version = server.update_weights_from_disk(tmp_path / "ckpt", full=False)
    assert version == reference.update_weights_from_disk(tmp_path / "ckpt", full=False)
    outs = _generate_both(server, reference, make_prompts(text_model.vocab_size, [6], seed=31), SAMPLED)
    assert outs[0].weight_version == version


@pytest.mark.parametrize("bad", ["shape", "name", "nan", "dtype"])
def test_a_bad_update_is_refused_and_the_old_weights_serve(server, reference, text_model, bad) -> None:
    name, tensor = _perturbed(text_model, seed=3)[0]
    update = {"shape": [(name, tensor[:, :-1])], "name": [("model.layers.0.mlp.nope.weight", tensor)],
              "nan": [(name, torch.full_like(tensor, float("nan")))], "dtype": [(name, tensor.to(torch.int32))]}[bad]
    prompts = make_prompts(text_model.vocab_size, [5], seed=32)
    before = server.generate(input_ids=prompts, sampling_params=GREEDY)[0]
    with pytest.raises((ValueError, TypeError)) as want:
        reference.update_weights(update)
    with pytest.raises(type(want.value)) as got:
        server.update_weights(update)
    assert str(got.value) == str(want.value)
    after = server.generate(input_ids=prompts, sampling_params=GREEDY)[0]
    assert after.weight_version == before.weight_version and after.token_ids == before.token_ids


def test_update_from_a_missing_directory(server, reference, tmp_path) -> None:
    with pytest.raises(ValueError) as want:
        reference.update_weights_from_disk(str(tmp_path / "missing"))
    with pytest.raises(ValueError) as got:
        server.update_weights_from_disk(str(tmp_path / "missing"))
    assert str(got.value) == str(want.value)


def test_an_update_mid_stream_shows_in_the_version_spans(server, reference, text_model) -> None:
    params = SamplingParams(temperature=0, max_new_tokens=400, ignore_eos=True)
    update = _perturbed(text_model, seed=4)
    deltas = []
    version = None
    for delta in server.stream(list(range(10, 20)), params):
        deltas.append(delta)
        if version is None:
            version = server.update_weights(update)  # pause_mode "retract": it resumes under the new weights
            assert version == reference.update_weights(update)
    out = deltas[-1].output
    assert out.finish_reason == "length" and out.weight_version == version
    (old, start, cut), (new, cut_again, end) = out.weight_versions
    assert (old, new, start, end) == (version - 1, version, 0, 400) and cut == cut_again and 0 < cut < 400
    assert sum((d.token_ids for d in deltas), []) == out.token_ids


def test_an_update_with_pause_mode_abort_ends_a_stream(server, reference, text_model) -> None:
    params = SamplingParams(temperature=0, max_new_tokens=400, ignore_eos=True)
    update = _perturbed(text_model, seed=5)
    deltas = []
    for delta in server.stream(list(range(20, 30)), params):
        deltas.append(delta)
        if len(deltas) == 1:
            assert server.update_weights(update, pause_mode="abort") == reference.update_weights(update)
    assert deltas[-1].finished and deltas[-1].output.finish_reason == "abort" and len(deltas[-1].output.token_ids) < 400


def test_update_from_a_trainer_over_a_gloo_group(server, reference, text_model) -> None:
    from rollout.distributed.ports import free_port
    from weightsync.transports.broadcast import BroadcastSender
    from weightsync.transports.group import close_group, open_group

    port = free_port()
    joined = server.init_weight_sync_group("127.0.0.1", port, rank_offset=1, world_size=2, timeout_s=60, wait=False)
    assert server.health().ok  # the engine serves while it waits for the trainer to join
    group = open_group("127.0.0.1", port, 0, 2, backend="gloo", timeout_s=60)  # the trainer: rank 0, this process
    try:
        assert joined.result(timeout=60) is None
        update = _perturbed(text_model, seed=6)
        pending = server.update_weights_from_distributed(full=False, wait=False)
        BroadcastSender(group).send(update)
        assert pending.result(timeout=60) == reference.update_weights(update)
    finally:
        server.destroy_weight_sync_group()
        close_group(group)
    _generate_both(server, reference, make_prompts(text_model.vocab_size, [5], seed=33), SAMPLED)


def test_cuda_ipc_needs_a_cuda_engine(server) -> None:
    with pytest.raises(ValueError, match="CUDA IPC needs a CUDA engine"):
        server.update_weights_from_ipc("ipc:///tmp/rollout-test-ipc.sock")
    with pytest.raises(ValueError, match="loopback"):
        server.update_weights_from_ipc("tcp://10.0.0.1:5000")


def test_update_targets_are_checked_as_in_process(server, reference, text_model, tmp_path) -> None:
    update = _perturbed(text_model, seed=7)[:1]
    save_safetensors_dir(update, tmp_path / "ckpt")
    cases = [
        lambda e: e.update_weights(update, target="draft"),  # this engine has no draft model
        lambda e: e.update_weights(update, target="nope"),
        lambda e: e.update_weights_from_disk(str(tmp_path / "ckpt"), full=False, target="nope"),
        lambda e: e.update_weights_from_disk(str(tmp_path / "ckpt"), lora_name="a", target="draft"),
    ]
    version = server.health().weight_version
    for i, case in enumerate(cases):
        with pytest.raises((ValueError, TypeError)) as want:
            case(reference)
        with pytest.raises(type(want.value)) as got:
            case(server)
        assert str(got.value) == str(want.value), i
    assert server.health().weight_version == version == reference.weight_version
