"""The weight-broadcast benchmark (benchmarks/broadcast.py) under torchrun on CPU with gloo:
trainer rank 0 and one engine, every row timed. Started as `-m benchmarks.broadcast` outside
the repo (cwd = a temp dir, PYTHONPATH = the checkout), as BENCHMARKS.md runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import TinyModel
from rollout.distributed.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_broadcast_bench_runs_every_row_on_cpu(tmp_path: Path) -> None:
    tiny = TinyModel("llama", tmp_path / "tiny")
    out_file = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "benchmarks.broadcast", "--model", tiny.path, "--repeats", "1",
           "--bucket-mb", "1", "--output", str(out_file), "--timeout-s", "60"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, f"rc {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    rows = json.loads(out_file.read_text())["bench_broadcast"]["rows"]
    assert [r["name"].split(",")[0] for r in rows[:3]] == ["torch.distributed.broadcast", "weight group", "weight group"]
    assert len(rows) == 7 and all(r["gb_s"] > 0 for r in rows)
    assert [r["name"] for r in rows[4:6]] == ["BroadcastSender -> receive, hold every bucket",
                                              "engine.update_weights of held tensors"]
    assert "of torch bcast" in proc.stdout
