"""RolloutOutputs <-> one uint8 tensor, to cross torch.distributed without pickle.

Layout (little-endian):
    uint64  header length H
    H bytes JSON header: per output its small fields (ids, indices, finish reason, text,
            versions, lengths); no token data
    pad to a multiple of 8
    int64   token section: for each output, its prompt ids then its generated ids
    float64 logprobs of the generated tokens, in the same order

Tokens and logprobs are the bulk and travel as raw arrays; float64 keeps the engine's
float32-derived Python floats bit-exact. The JSON carries what is small and irregular.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict

import numpy as np
import torch

from rollout.request import RolloutOutput

_VERSION = 1
_SMALL_FIELDS = ("request_id", "prompt_index", "sample_index", "finish_reason", "text", "num_cached_tokens",
                 "weight_version", "weight_versions", "top_logprobs")


def pack_outputs(outputs: Sequence[RolloutOutput]) -> torch.Tensor:
    header = {
        "version": _VERSION,
        "outputs": [
            {**{f: getattr(o, f) for f in _SMALL_FIELDS}, "prompt_len": len(o.prompt_ids), "num_tokens": len(o.token_ids)}
            for o in outputs
        ],
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    pad = -(8 + len(head)) % 8
    tokens = np.fromiter((t for o in outputs for t in (*o.prompt_ids, *o.token_ids)), dtype=np.int64)
    logprobs = np.fromiter((x for o in outputs for x in o.logprobs), dtype=np.float64)
    blob = b"".join([np.uint64(len(head)).tobytes(), head, b"\0" * pad, tokens.tobytes(), logprobs.tobytes()])
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def unpack_outputs(buf: torch.Tensor) -> list[RolloutOutput]:
    raw = buf.cpu().numpy().tobytes()
    head_len = int(np.frombuffer(raw[:8], dtype=np.uint64)[0])
    header = json.loads(raw[8 : 8 + head_len])
    if header.get("version") != _VERSION:
        raise ValueError(f"rollout buffer version {header.get('version')!r}, expected {_VERSION}")
    metas = header["outputs"]
    start = 8 + head_len + (-(8 + head_len) % 8)
    num_ids = sum(m["prompt_len"] + m["num_tokens"] for m in metas)
    num_lp = sum(m["num_tokens"] for m in metas)
    ids = np.frombuffer(raw, dtype=np.int64, count=num_ids, offset=start).tolist()
    lps = np.frombuffer(raw, dtype=np.float64, count=num_lp, offset=start + 8 * num_ids).tolist()
    outputs, i, j = [], 0, 0
    for m in metas:
        p, n = m.pop("prompt_len"), m.pop("num_tokens")
        m["weight_versions"] = [tuple(span) for span in m["weight_versions"]]
        if m["top_logprobs"] is not None:
            m["top_logprobs"] = [[tuple(pair) for pair in pos] for pos in m["top_logprobs"]]
        outputs.append(RolloutOutput(prompt_ids=ids[i : i + p], token_ids=ids[i + p : i + p + n], logprobs=lps[j : j + n], **m))
        i, j = i + p + n, j + n
    return outputs


def output_to_json(o: RolloutOutput) -> dict:
    return asdict(o)
