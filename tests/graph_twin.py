"""CPU twin of decode CUDA graphs: each "graph" is its capture function, replayed eagerly
into the same output buffer from the same static inputs, so the replay logic (static
buffers, padding up the ladder, what a backend fixes at capture and refreshes at replay)
runs without a GPU."""

from __future__ import annotations

import torch

from rollout.model.cuda_graph import DecodeGraphs


class _EagerGraph:
    """Stands in for torch.cuda.CUDAGraph: replay() re-runs the captured function into
    the same output buffer, reading the same static inputs."""

    def __init__(self, fn, out: torch.Tensor) -> None:
        self.fn, self.out = fn, out

    def replay(self) -> None:
        self.out.copy_(self.fn())


class EagerDecodeGraphs(DecodeGraphs):
    @torch.inference_mode()
    def capture(self) -> None:
        for bs in reversed(self.sizes):
            for variant in self.variants(bs):
                fb = self._static_batch(bs, variant)

                def fn(fb=fb, with_lora=variant.lora):
                    self.plan_capture(fb, with_lora)  # a real graph keeps this plan baked in
                    return self.model.logits(self.model(fb.input_ids, fb.positions, self.backend))

                logits = fn().clone()
                self.logits[bs, variant] = logits
                self.graphs[bs, variant] = _EagerGraph(fn, logits)
