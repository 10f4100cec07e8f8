"""LoRA-only updates as one flat buffer (lora.FlatLoraAdapter) and of several adapters in one
call (engine.update_lora_adapters), against peft: the new adapter's outputs equal peft's
with the new weights whether the adapter sits in a slot or only in its host copy, the
trainer's own parameters can be the buffer (weightsync.flat_lora_parameters), every bad
buffer or layout is refused naming the field or tensor with nothing changed, a batch is
atomic across its adapters and checks all their values in one pass, and a layout is
validated once."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from conftest import TinyModel, make_prompts

from lora import update as lora_update
from lora.flat import FlatLayout, FlatLoraAdapter
from rollout import Engine, EngineConfig
from weightsync import iter_hf_weights
from weightsync.flat_lora import flat_lora_parameters

peft = pytest.importorskip("peft")
from peft_ref import ADAPTERS, GREEDY, NEW, PeftRef, randomize_adapter  # noqa: E402


@pytest.fixture(scope="module")
def ref(llama: TinyModel, tmp_path_factory) -> PeftRef:
    return PeftRef(llama, tmp_path_factory.mktemp("adapters"))


def _engine(llama: TinyModel, ref: PeftRef, **kw) -> Engine:
    engine = Engine(EngineConfig(**(dict(model=llama.path, enable_lora=True, max_loras_per_batch=4, max_lora_rank=16)
                                    | kw)))
    for name in ADAPTERS:
        engine.load_lora_adapter(name, ref.dirs[name])
    return engine


def _trainer(ref: PeftRef, adapter: str, seed: int):
    trainer = copy.deepcopy(ref.model)
    trainer.set_adapter(adapter)
    randomize_adapter(trainer, adapter, seed=seed)
    trainer.eval()
    return trainer


@torch.no_grad()
def _greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    return model.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
                          attention_mask=torch.ones_like(ids))[0, len(prompt):].tolist()


@pytest.mark.parametrize("resident", [True, False], ids=["in-a-slot", "host-copy-only"])
def test_flat_update_equals_peft(llama: TinyModel, ref: PeftRef, resident: bool) -> None:
    # one slot: with "c" served last, "a" is only in its host copy when the update comes
    engine = _engine(llama, ref, max_loras_per_batch=1)
    prompt = make_prompts(llama.vocab_size, [9], seed=80)[0]
    engine.generate(input_ids=[prompt], sampling_params=GREEDY, lora_name="a")
    if not resident:
        engine.generate(input_ids=[prompt], sampling_params=GREEDY, lora_name="c")
    assert (engine.lora.slot_of("a") is not None) == resident
    trainer = _trainer(ref, "a", seed=900)
    # sent in bf16 into the fp32 engine (a cast on the copy); the trainer takes the same
    # rounded values, so peft and the engine compute with identical weights
    flat = FlatLoraAdapter.pack(iter_hf_weights(trainer, adapter_only=True), dtype=torch.bfloat16)
    params = dict(trainer.named_parameters())
    with torch.no_grad():
        for name, view in flat.named_tensors():
            params[name.replace(".weight", ".a.weight")].copy_(view)
    assert engine.update_lora_adapter("a", flat) == 1
    outs = engine.generate(input_ids=[prompt, prompt], sampling_params=GREEDY, lora_name=["a", "b"])
    assert outs[0].token_ids == _greedy(trainer, prompt) and outs[0].lora_versions == [(1, 0, NEW)]
    assert outs[1].token_ids == ref.greedy("b", prompt)


def test_partial_flat_update_keeps_the_rest(llama: TinyModel, ref: PeftRef) -> None:
    engine = _engine(llama, ref)
    prompt = make_prompts(llama.vocab_size, [8], seed=81)[0]
    trainer = _trainer(ref, "c", seed=901)
    # only down_proj changes: the trainer's other tensors go back to the loaded ones
    new = dict(iter_hf_weights(trainer, adapter_only=True))
    loaded = dict(ref.model.named_parameters())
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            if ".c." in name and "lora_" in name and "down_proj" not in name:
                p.copy_(loaded[name])
    down = {n: t for n, t in new.items() if "down_proj" in n}
    assert down and len(down) < len(new)
    engine.update_lora_adapter("c", FlatLoraAdapter.pack(down))
    out = engine.generate(input_ids=[prompt], sampling_params=GREEDY, lora_name="c")[0]
    assert out.token_ids == _greedy(trainer, prompt)


def _named(ref: PeftRef, adapter: str) -> list[tuple[str, torch.Tensor]]:
    ref.model.set_adapter(adapter)
    return [(n, t.clone()) for n, t in iter_hf_weights(ref.model, adapter_only=True)]


def test_trainer_parameters_as_the_flat_buffer(llama: TinyModel, ref: PeftRef) -> None:
    engine = _engine(llama, ref)
    prompt = make_prompts(llama.vocab_size, [10], seed=82)[0]
    trainer = copy.deepcopy(ref.model)
    trainer.set_adapter("b")
    flat = flat_lora_parameters(trainer)
    params = [p for n, p in trainer.named_parameters() if ".b." in n and "lora_" in n]
    start, end = flat.buffer.data_ptr(), flat.buffer.data_ptr() + flat.buffer.numel() * flat.buffer.element_size()
    assert params and all(start <= p.data_ptr() < end for p in params), "parameters must live in the buffer"
    randomize_adapter(trainer, "b", seed=902)  # an "optimizer step": in place, so into the buffer
    trainer.eval()
    engine.update_lora_adapter("b", flat)
    assert engine.generate(input_ids=[prompt], sampling_params=GREEDY, lora_name="b")[0].token_ids == _greedy(trainer, prompt)
    randomize_adapter(trainer, "b", seed=903)  # the next step: the same buffer, the same layout
    engine.update_lora_adapter("b", flat)
    assert engine.generate(input_ids=[prompt], sampling_params=GREEDY, lora_name="b")[0].token_ids == _greedy(trainer, prompt)


def test_batched_update_is_one_check_and_atomic(llama: TinyModel, ref: PeftRef, monkeypatch) -> None:
    engine = _engine(llama, ref, max_loras_per_batch=2)  # "c" stays in its host copy
    prompts = make_prompts(llama.vocab_size, [7, 7, 7], seed=83)
    engine.generate(input_ids=prompts[:2], sampling_params=GREEDY, lora_name=["a", "b"])
    trainers = {name: _trainer(ref, name, seed=910 + i) for i, name in enumerate(ADAPTERS)}
    updates = {"a": FlatLoraAdapter.pack(iter_hf_weights(trainers["a"], adapter_only=True)),
               "b": list(iter_hf_weights(trainers["b"], adapter_only=True)),  # by name, in the same call
               "c": FlatLoraAdapter.pack(iter_hf_weights(trainers["c"], adapter_only=True))}
    checks = []
    real = lora_update.first_non_finite
    monkeypatch.setattr(lora_update, "first_non_finite", lambda tensors: checks.append(len(tensors)) or real(tensors))

    bad_c = dataclasses.replace(updates["c"], buffer=updates["c"].buffer.clone())
    bad_name = bad_c.layout.names[5]
    bad_c.view(bad_name)[0, 0] = float("inf")
    with pytest.raises(ValueError, match=f"adapter 'c': adapter tensor '{bad_name}' has non-finite"):
        engine.update_lora_adapters({"a": updates["a"], "b": updates["b"], "c": bad_c})
    assert [i.version for i in engine.list_lora_adapters()] == [0, 0, 0], "a refused batch changed an adapter"
    assert len(checks) == 1, "every value of every adapter in one pass (one host sync)"
    for prompt, name in zip(prompts, ADAPTERS):
        assert engine.generate(input_ids=[prompt], sampling_params=GREEDY, lora_name=name)[0].token_ids == \
            ref.greedy(name, prompt)

    checks.clear()
    assert engine.update_lora_adapters(updates) == {"a": 1, "b": 1, "c": 1}
    assert len(checks) == 1, "every value of every adapter in one pass (one host sync)"
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_name=list(ADAPTERS))
    for out, prompt, name in zip(outs, prompts, ADAPTERS):
        assert out.token_ids == _greedy(trainers[name], prompt), name


def test_layout_is_validated_once(llama: TinyModel, ref: PeftRef, monkeypatch) -> None:
    engine = _engine(llama, ref)
    flat = FlatLoraAdapter.pack(_named(ref, "a"))
    calls = []
    real = lora_update.plan_flat_layout
    monkeypatch.setattr(lora_update, "plan_flat_layout", lambda *a: calls.append(1) or real(*a))
    engine.update_lora_adapter("a", flat)
    engine.update_lora_adapter("a", flat)  # the same layout object
    engine.update_lora_adapter("a", FlatLoraAdapter.pack(_named(ref, "a")))  # an equal one
    assert len(calls) == 1
    engine.update_lora_adapter("a", FlatLoraAdapter.pack(_named(ref, "a")[:4]))  # another layout
    assert len(calls) == 2


def _edit_layout(flat: FlatLoraAdapter, **changes) -> FlatLoraAdapter:
    return FlatLoraAdapter(flat.buffer, dataclasses.replace(flat.layout, **changes))


@pytest.mark.parametrize(
    "edit, message",
    [
        ("nan", r"adapter 'a': adapter tensor '.*q_proj.lora_A.weight' has non-finite values"),
        ("short_buffer", r"buffer has \d+ elements, its layout needs \d+"),
        ("2d_buffer", r"buffer must be a 1-D floating-point tensor"),
        ("int_buffer", r"buffer must be a 1-D floating-point tensor"),
        ("strided_buffer", r"buffer must be contiguous"),
        ("shape", r"adapter tensor '.*': shape \(8, 63\) in the flat layout does not match the loaded lora_A \(8, 64\)"),
        ("unknown", r"adapter tensor 'model.layers.0.mlp.wrong_proj.lora_A.weight': unknown target module"),
        ("outside", r"offset \d+ \+ \d+ elements lies outside the flat layout"),
        ("overlap", r"overlap in the flat layout"),
        ("twice", r"given twice in one update"),
        ("not_flat", r"for a dict pass .items\(\)"),
    ],
)
def test_bad_flat_updates_are_refused_and_the_engine_keeps_serving(llama: TinyModel, ref: PeftRef, edit: str,
                                                                   message: str) -> None:
    engine = _engine(llama, ref)
    prompt = make_prompts(llama.vocab_size, [6], seed=84)[0]
    accepted = engine.add_request(prompt, GREEDY, lora_name="a")[0]
    engine.step()
    flat = FlatLoraAdapter.pack(_named(ref, "a"))
    names, shapes, offsets = list(flat.layout.names), list(flat.layout.shapes), list(flat.layout.offsets)
    if edit == "nan":
        bad = FlatLoraAdapter(flat.buffer.clone(), flat.layout)
        bad.buffer[7] = float("nan")
    elif edit == "short_buffer":
        bad = FlatLoraAdapter(flat.buffer[:-1], flat.layout)
    elif edit == "2d_buffer":
        bad = FlatLoraAdapter(flat.buffer.view(1, -1), flat.layout)
    elif edit == "int_buffer":
        bad = FlatLoraAdapter(flat.buffer.long(), flat.layout)
    elif edit == "strided_buffer":
        bad = FlatLoraAdapter(torch.zeros(2 * flat.buffer.numel())[::2], flat.layout)
    elif edit == "shape":
        shapes[0] = (8, 63)
        bad = _edit_layout(flat, shapes=tuple(shapes))
    elif edit == "unknown":
        names[0] = "model.layers.0.mlp.wrong_proj.lora_A.weight"
        bad = _edit_layout(flat, names=tuple(names))
    elif edit == "outside":
        offsets[-1] = flat.layout.numel
        bad = _edit_layout(flat, offsets=tuple(offsets))
    elif edit == "overlap":
        offsets[1] = offsets[0] + 1
        bad = _edit_layout(flat, offsets=tuple(offsets))
    elif edit == "twice":
        names[1] = names[0].replace("base_model.model.", "")
        shapes[1] = shapes[0]
        bad = _edit_layout(flat, names=tuple(names), shapes=tuple(shapes))
    else:
        bad = {"buffer": flat.buffer}  # a plain dict is no flat adapter: read as (name, tensor) pairs
    error = TypeError if edit == "not_flat" else ValueError
    with pytest.raises(error, match=message):
        engine.update_lora_adapter("a", bad)
    assert [i.version for i in engine.list_lora_adapters()] == [0, 0, 0]
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    assert outs[accepted].token_ids == ref.greedy("a", prompt)
    assert engine.generate(input_ids=[prompt], sampling_params=GREEDY, lora_name="a")[0].token_ids == \
        ref.greedy("a", prompt)


def test_flat_layout_is_plain_data() -> None:
    layout = FlatLayout.canonical([("model.layers.0.self_attn.q_proj.lora_B.weight", (4, 2)),
                                   ("model.layers.0.self_attn.q_proj.lora_A.weight", (2, 4))])
    assert layout.names[0].endswith("lora_A.weight") and layout.offsets == (0, 8) and layout.numel == 16
    assert layout == FlatLayout(layout.names, layout.shapes, layout.offsets, layout.numel) and len(layout) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device-side copies and NaN check of a CUDA engine")
def test_gpu_flat_update_writes_what_the_update_by_name_writes(llama: TinyModel, ref: PeftRef) -> None:
    common = dict(device="cuda", max_total_tokens=2048, cuda_graph=False, attention="triton")
    by_name, by_flat = _engine(llama, ref, **common), _engine(llama, ref, **common)
    prompt = make_prompts(llama.vocab_size, [9], seed=85)[0]
    for engine in (by_name, by_flat):  # a and c resident in slots
        engine.generate(input_ids=[prompt, prompt], sampling_params=GREEDY, lora_name=["a", "c"])
    trainers = {name: _trainer(ref, name, seed=920 + i) for i, name in enumerate(("a", "c"))}
    named = {name: [(n, t.cuda()) for n, t in iter_hf_weights(t_, adapter_only=True)] for name, t_ in trainers.items()}
    flats = {name: FlatLoraAdapter.pack(pairs) for name, pairs in named.items()}  # on the device
    bad = FlatLoraAdapter(flats["c"].buffer.clone(), flats["c"].layout)
    bad.buffer[-1] = float("nan")  # the last matrix: down_proj's lora_B of the last layer
    with pytest.raises(ValueError, match=r"adapter 'c': adapter tensor '.*layers\.1\.mlp\.down_proj\.lora_B.*' has non-finite"):
        by_flat.update_lora_adapters({"a": flats["a"], "c": bad})
    assert by_name.update_lora_adapters(named) == by_flat.update_lora_adapters(flats) == {"a": 1, "c": 1}
    for m in by_name.lora.pool.a_stack:
        assert torch.equal(by_name.lora.pool.a_stack[m], by_flat.lora.pool.a_stack[m]), m
        assert torch.equal(by_name.lora.pool.b_stack[m], by_flat.lora.pool.b_stack[m]), m
    outs = [e.generate(input_ids=[prompt] * 2, sampling_params=GREEDY, lora_name=["a", "c"]) for e in (by_name, by_flat)]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    for out, name in zip(outs[1], ("a", "c")):
        assert out.token_ids == _greedy(trainers[name], prompt), name
