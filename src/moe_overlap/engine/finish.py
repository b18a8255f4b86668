"""When a request ends: the tokens a step gives it, taken in order up to the first that ends it
(EOS, a stop string or token id, ``max_new_tokens``, the context)."""

from __future__ import annotations

from dataclasses import dataclass

from moe_overlap.core.step import GroupReply, TokenLogprobs
from moe_overlap.engine.request import Request
from moe_overlap.engine.speculation import Speculation


@dataclass(frozen=True)
class FinishRule:
    eos: int | None  # the model's EOS token id
    max_len: int  # the context

    def take(
        self,
        req: Request,
        reply: GroupReply,
        i: int,
        drafts: int,
        speculation: Speculation | None = None,
    ) -> None:
        """Sequence ``i``'s new tokens in order (a verify step's accepted ones after the
        first), up to the first that ends it; no token past it is kept. The cache keeps the
        fed tokens that were accepted; the rejected drafts' entries lie past ``num_computed``,
        overwritten by later steps and never read."""
        more = reply.more_ids[i] if reply.more_ids else []
        if drafts and speculation is not None:
            speculation.record(drafts, len(more))
        req.num_computed -= drafts - len(more)
        req.mtp_drafts = reply.drafts[i] if reply.drafts else []
        asked = reply.more_logprobs[i] if reply.more_logprobs else []
        more_lps: list[TokenLogprobs | None] = [*asked] or [None] * len(more)
        tokens = [reply.token_ids[i], *more]
        try:
            for token, lp in zip(tokens, [reply.logprobs[i], *more_lps], strict=True):
                assert token is not None  # the caller handles a failed draw
                req.take(token, lp)
                req.finish_reason = self.reason(req)
                if req.finish_reason:
                    break
        except Exception as exc:  # e.g. its text: this request's fault ends it alone
            req.error = f"{type(exc).__name__}: {exc}".splitlines()[0]
            req.finish_reason = "error"

    def reason(self, req: Request) -> str | None:
        """Why ``req`` ends after its last token, or None."""
        token = req.output_ids[-1]
        if not req.params.ignore_eos and self.eos is not None and token == self.eos:
            return "eos"
        if token in (req.params.stop_token_ids or []):
            return "stop"  # kept in the ids, not in the text (as vLLM and SGLang, like EOS)
        search = len(req.output_ids) > req.params.min_tokens  # stop strings wait for it
        if req.text is not None and req.text.push(token, search):  # other tokens: the text
            return "stop"
        if req.constraint is not None and req.constraint.done:  # its grammar took its stop token
            return "stop"
        if len(req.output_ids) >= req.params.max_new_tokens:
            return "length"
        if req.total_len >= self.max_len:
            return "context"
        return None
