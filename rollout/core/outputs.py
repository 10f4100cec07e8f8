"""When a request is done, and what it hands back: stop conditions (EOS, stop token ids,
length, stop strings) and the RolloutOutput with its text cut at the first stop string.

Knows the tokenizer and the EOS ids; does not know queues or devices.
"""

from __future__ import annotations

from rollout.request import Req, RolloutOutput


class Outputs:
    def __init__(self, tokenizer, eos_token_ids: set[int], context_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.context_len = context_len

    def check_finish(self, req: Req, token: int) -> bool:
        """Set req.finish_reason if `token` (just appended) ends the request."""
        p = req.params
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            req.finish_reason = "stop"
        elif len(req.output_ids) >= p.max_new_tokens or req.known_len >= self.context_len:
            req.finish_reason = "length"
        elif p.stop and self._stop_string_hit(req):
            req.finish_reason = "stop"
        return req.finish_reason is not None

    def _stop_string_hit(self, req: Req) -> bool:
        assert self.tokenizer is not None
        window = max(len(s) for s in req.params.stop) + 8  # tokens are >= 1 char, so this covers any stop string
        tail = self.tokenizer.decode(req.output_ids[-window:], skip_special_tokens=True)
        return any(s in tail for s in req.params.stop)

    def make(self, req: Req, current_version: int) -> RolloutOutput:
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
            cuts = [text.find(s) for s in req.params.stop if s in text]
            if cuts:
                text = text[: min(cuts)]
        return RolloutOutput.from_req(req, text, current_version)
