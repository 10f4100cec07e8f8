"""CPU twin of decode CUDA graphs: each "graph" is its capture function, replayed eagerly
into the same output buffer from the same static inputs, so the replay logic (static
buffers, padding up the ladder, what a backend fixes at capture and refreshes at replay)
runs without a GPU.

Capture plans every graph, as a real capture does, but runs a graph's forward only at its
first replay: most tests replay two or three of the ladder's sizes, and under the Triton
interpreter each forward of the rest would cost seconds for nothing."""

from __future__ import annotations

import torch

from rollout.model.cuda_graph import DecodeGraphs


class _EagerGraph:
    """Stands in for torch.cuda.CUDAGraph: replay() re-runs the captured function and writes
    the graph's output buffer, made at the first replay and the same tensor from then on."""

    def __init__(self, fn, outputs: dict, key) -> None:
        self.fn, self.outputs, self.key = fn, outputs, key

    def replay(self) -> None:
        out = self.fn()
        if self.key in self.outputs:
            self.outputs[self.key].copy_(out)
        else:
            self.outputs[self.key] = out.clone()


class EagerDecodeGraphs(DecodeGraphs):
    @torch.inference_mode()
    def capture(self) -> None:
        for bs in reversed(self.sizes):
            for variant in self.variants(bs):
                fb = self._static_batch(bs, variant)
                self.plan_capture(fb, variant.lora)  # what a real capture fixes, checked here too

                def fn(fb=fb, with_lora=variant.lora):
                    self.plan_capture(fb, with_lora)  # a real graph keeps this plan baked in
                    return self.model.logits(self.model(fb.input_ids, fb.positions, self.backend))

                self.graphs[bs, variant] = _EagerGraph(fn, self.logits, (bs, variant))
