"""OpenAI response, chunk and usage shapes for completions and chat completions."""

from __future__ import annotations

import codecs
import json
from typing import Any

from kvserve.engine.sampler import TokenLogprobs
from kvserve.outputs import RequestOutput, StreamChunk
from kvserve.server.protocol import usage_dict
from kvserve.text.tool_calls import Delta, ToolCallParser, ToolFormat, parse

# Characters that end a line for str.splitlines (and clients built on it, such as httpx's
# iter_lines) but that json.dumps leaves raw with ensure_ascii=False.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _sampled(lp: TokenLogprobs, decode) -> dict[str, float]:
    """The sampled token's entry, where the top ones do not hold it already."""
    return {} if any(t == lp.token_id for t, _ in lp.top) else {decode([lp.token_id]): lp.logprob}


def event(payload: dict) -> str:
    """One server-sent event, on one line for every client's idea of a line."""
    return f"data: {json.dumps(payload, ensure_ascii=False).translate(_LINE_BREAKS)}\n\n"


class Formatter:
    """OpenAI response and chunk shapes for completions and chat completions."""

    def __init__(self, llm, response_id, created, model, kind, chat, echo_texts, tool_formats=None) -> None:
        self.tokenizer = llm.tokenizer
        self.id, self.created, self.model, self.kind, self.chat = response_id, created, model, kind, chat
        self.echo_texts = echo_texts
        self.first_chunk = [True] * len(echo_texts)
        self.tool_formats: list[ToolFormat | None] = tool_formats or [None] * len(echo_texts)
        self.tool_parsers = [ToolCallParser(f) if f is not None else None for f in self.tool_formats]
        # completions' text_offset, per choice: characters of its text so far (its echo first), and the
        # bytes of a character its tokens have begun but not ended (a token may end within one)
        self.text_offsets = [len(e or "") for e in echo_texts]
        self.offset_decoders = [codecs.getincrementaldecoder("utf-8")("replace") for _ in echo_texts]

    def _token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (a byte-level BPE's token may hold part of a character, which its
        decoded text shows as U+FFFD), else its decoded text's."""
        table = self.tokenizer.token_bytes
        if table is not None and 0 <= token_id < len(table):
            return table[token_id]
        return self.tokenizer.decode([token_id]).encode("utf-8")

    def _logprobs(self, logprobs: list[TokenLogprobs] | None, index: int = 0) -> dict | None:
        if not logprobs:
            return None
        decode = self.tokenizer.decode
        if self.chat:

            def entry(token_id: int, logprob: float) -> dict:
                return {"token": decode([token_id]), "logprob": logprob, "bytes": list(self._token_bytes(token_id))}

            return {
                "content": [
                    {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                    for lp in logprobs
                ]
            }
        tokens = [decode([lp.token_id]) for lp in logprobs]
        offsets, position, decoder = [], self.text_offsets[index], self.offset_decoders[index]
        for lp in logprobs:  # where each token starts in the choice's text, streamed or not
            offsets.append(position)
            position += len(decoder.decode(self._token_bytes(lp.token_id)))
        self.text_offsets[index] = position
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            # as OpenAI's and vLLM's: the top `logprobs` and the sampled token, so up to logprobs + 1
            "top_logprobs": [{**{decode([t]): v for t, v in lp.top}, **_sampled(lp, decode)} for lp in logprobs],
            "text_offset": offsets,
        }

    def chunk_events(self, index: int, chunk: StreamChunk) -> list[dict]:
        """The events of one engine chunk: one, or for an answer parsed for tool calls one per piece
        (content, a call's id and name, a piece of its arguments), as OpenAI streams them; none
        while a piece is not decided yet, or while the chunk's text is held back."""
        parser = self.tool_parsers[index]
        if parser is None:
            if not (chunk.text or chunk.logprobs or chunk.finish_reason):  # text held back (a stop string's
                return []  # start, a character's first bytes): nothing to send, as OpenAI sends no empty delta
            return [self.chunk_event(index, chunk)]
        deltas = parser.feed(chunk.text) + (parser.finish() if chunk.finish_reason is not None else [])
        events = [self._chat_event(index, _delta(d), None, None) for d in deltas]
        if chunk.logprobs or chunk.finish_reason is not None:
            if not events:
                events.append(self._chat_event(index, {}, None, None))
            events[0]["choices"][0]["logprobs"] = self._logprobs(chunk.logprobs)
            reason = chunk.finish_reason
            events[-1]["choices"][0]["finish_reason"] = (
                "tool_calls" if reason == "stop" and parser.num_calls else reason
            )
        return events

    def _chat_event(self, index: int, delta: dict, logprobs: dict | None, finish_reason: str | None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    def chunk_event(self, index: int, chunk: StreamChunk | None, role: bool = False) -> dict:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if chunk is not None and chunk.text:
                delta["content"] = chunk.text
            logprobs = self._logprobs(chunk.logprobs if chunk else None)
            return self._chat_event(index, delta, logprobs, chunk.finish_reason if chunk else None)
        choice = {
            "index": index,
            "text": chunk.text,
            "logprobs": self._logprobs(chunk.logprobs, index),
            "finish_reason": chunk.finish_reason,
        }
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    def usage_event(self, finals: list[StreamChunk | None], prompt_indices: list[int]) -> dict:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": self._usage([f.usage if f else None for f in finals], prompt_indices),
        }

    @staticmethod
    def _usage(usages, prompt_indices: list[int]) -> dict:
        prompt = cached = completion = 0
        seen = set()
        for usage, p_index in zip(usages, prompt_indices, strict=True):
            if usage is None:
                continue
            completion += usage.completion_tokens
            if p_index not in seen:  # n choices of one prompt count the prompt once, as OpenAI does
                seen.add(p_index)
                prompt += usage.prompt_tokens
                cached += usage.cached_tokens
        return usage_dict(prompt, completion, cached)

    def full_response(self, outputs: list[RequestOutput], prompt_indices: list[int]) -> dict:
        choices = []
        for index, output in enumerate(outputs):
            text, logprobs = output.text, output.logprobs
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                reason = output.finish_reason
                if self.tool_formats[index] is not None:
                    answer = parse(text, self.tool_formats[index])
                    message["content"] = answer.content
                    if answer.tool_calls:
                        message["tool_calls"] = [call.as_openai() for call in answer.tool_calls]
                        reason = "tool_calls" if reason == "stop" else reason
                choices.append(
                    {"index": index, "message": message, "logprobs": self._logprobs(logprobs), "finish_reason": reason}
                )
            else:
                echo = self.echo_texts[index] or ""
                choices.append(
                    {
                        "index": index,
                        "text": echo + text,
                        "logprobs": self._logprobs(logprobs, index),
                        "finish_reason": output.finish_reason,
                    }
                )
        usage = self._usage([o.usage for o in outputs], prompt_indices)
        return {
            "id": self.id,
            "object": self.kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        }


def _delta(piece: Delta) -> dict[str, Any]:
    """A parsed piece as a chat chunk's delta."""
    if piece.content is not None:
        return {"content": piece.content}
    if piece.id is not None:
        function = {"name": piece.name, "arguments": ""}
        return {"tool_calls": [{"index": piece.index, "id": piece.id, "type": "function", "function": function}]}
    return {"tool_calls": [{"index": piece.index, "function": {"arguments": piece.arguments}}]}
