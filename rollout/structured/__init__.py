"""Structured output: a request's tokens constrained to a JSON schema, a regex or an EBNF
grammar (xgrammar, the `structured` extra).

- spec.py: the three SamplingParams fields, checked at the API, and xgrammar's parse of them
- compiler.py: spec -> compiled grammar on a thread pool, cached by text
- matcher.py: one request's matcher (CPU state), kept in step with its output tokens
- bitmask.py: the step's token mask, filled for constrained rows and applied on the device
- service.py: the step loop's grammar hook (rollout/core/hooks.py Grammar), which the engine
  plugs in; the one module here above the core (docs/architecture.md)

The sampler draws from the masked logits (`processed` log-probs are under that distribution)
and reports `raw` log-probs from the unmasked ones, as a trainer recomputes them.
"""
