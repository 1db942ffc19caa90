"""Per-request text: incremental detokenization, stop strings, and what a stream may show yet.

Runs on the engine thread so that a stop string finishes its request in the same step.
"""

from __future__ import annotations

from kvserve.engine.request import Request
from kvserve.engine.sampler import TokenLogprobs
from kvserve.outputs import StreamChunk, Usage
from kvserve.text.detokenizer import IncrementalDetokenizer
from kvserve.text.tokenizer import Tokenizer


class RequestTextState:
    def __init__(self, request: Request, tokenizer: Tokenizer) -> None:
        self.request = request
        self.stops = request.params.stop
        self.max_stop_len = max((len(s) for s in self.stops), default=0)
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=request.params.skip_special_tokens)
        self.text = ""  # text of the tokens so far, cut at a stop string if one matched
        self.num_sent_chars = 0
        self.num_sent_tokens = 0
        self.stopped_by_string: str | None = None

    def add_token(self, token: int, is_last: bool) -> None:
        """Feed the request's newest token. Sets `stopped_by_string` if a stop string appeared."""
        request = self.request
        before = len(self.text)
        if not (request.stop_reason == token and request.is_finished):  # a stop token adds no text
            self.text += self.detokenizer.add([token])
        if is_last and self.stopped_by_string is None:
            self.text += self.detokenizer.flush()
        # A stop string counts where it ends in this token's text (one wholly before was looked for then);
        # as stop tokens are, stop strings are not looked for before min_tokens (vLLM's rules both).
        if self.stops and self.stopped_by_string is None and request.num_output_tokens >= request.params.min_tokens:
            hits = [(i, s) for s in self.stops if (i := self.text.find(s, max(0, before - len(s) + 1))) >= 0]
            if hits:
                index, stop = min(hits)
                self.text = self.text[:index]
                self.stopped_by_string = stop

    def chunk(self, logprobs: list[TokenLogprobs] | None = None, force_final: bool = False) -> StreamChunk:
        """The new text and tokens since the last chunk; holds back a possible partial stop string."""
        request = self.request
        final = request.is_finished or force_final
        end = len(self.text) if final else len(self.text) - self._holdback()
        text = self.text[self.num_sent_chars : end] if end > self.num_sent_chars else ""
        self.num_sent_chars = max(self.num_sent_chars, end)
        token_ids = request.output_token_ids[self.num_sent_tokens :]
        self.num_sent_tokens = len(request.output_token_ids)
        chunk = StreamChunk(request.request_id, text, token_ids, logprobs=logprobs)
        if final:
            reason = request.finish_reason
            chunk.finish_reason = reason.value if reason is not None else "abort"
            chunk.stop_reason = self.stopped_by_string or request.stop_reason
            chunk.usage = Usage(request.num_prompt_tokens, request.num_output_tokens, request.num_cached_tokens)
        return chunk

    def _holdback(self) -> int:
        """Length of the longest tail of the text that could still grow into a stop string."""
        for length in range(min(self.max_stop_len - 1, len(self.text)), 0, -1):
            tail = self.text[-length:]
            if any(stop.startswith(tail) for stop in self.stops):
                return length
        return 0
