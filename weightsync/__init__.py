"""Trainer -> engine weight transfer, engine-agnostic.

The engine side ends in one call: `engine.update_weights(named_tensors, full=...)` with
Hugging Face parameter names. Each transport turns its wire format back into that
(name, tensor) stream; the trainer side walks a model and pushes through a transport.
"""
