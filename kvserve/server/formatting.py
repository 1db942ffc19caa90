"""OpenAI response, chunk and usage shapes for completions and chat completions."""

from __future__ import annotations

import json
from typing import Any

from kvserve.engine.sampler import TokenLogprobs
from kvserve.outputs import RequestOutput, StreamChunk
from kvserve.server.protocol import usage_dict


def event(payload: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class Formatter:
    """OpenAI response and chunk shapes for completions and chat completions."""

    def __init__(self, llm, response_id, created, model, kind, chat, echo_texts) -> None:
        self.tokenizer = llm.tokenizer
        self.id, self.created, self.model, self.kind, self.chat = response_id, created, model, kind, chat
        self.echo_texts = echo_texts
        self.first_chunk = [True] * len(echo_texts)

    def _logprobs(self, logprobs: list[TokenLogprobs] | None, offset: int = 0) -> dict | None:
        if not logprobs:
            return None
        decode = self.tokenizer.decode
        if self.chat:

            def entry(token_id: int, logprob: float) -> dict:
                text = decode([token_id])
                return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

            return {
                "content": [
                    {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                    for lp in logprobs
                ]
            }
        tokens = [decode([lp.token_id]) for lp in logprobs]
        offsets, position = [], offset
        for token in tokens:
            offsets.append(position)
            position += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{decode([t]): v for t, v in lp.top} for lp in logprobs],
            "text_offset": offsets,
        }

    def chunk_event(self, index: int, chunk: StreamChunk | None, role: bool = False) -> dict:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if chunk is not None and chunk.text:
                delta["content"] = chunk.text
            choice = {
                "index": index,
                "delta": delta,
                "logprobs": self._logprobs(chunk.logprobs if chunk else None),
                "finish_reason": chunk.finish_reason if chunk else None,
            }
            return {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": [choice],
            }
        choice = {
            "index": index,
            "text": chunk.text,
            "logprobs": self._logprobs(chunk.logprobs),
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
                choices.append(
                    {
                        "index": index,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": self._logprobs(logprobs),
                        "finish_reason": output.finish_reason,
                    }
                )
            else:
                echo = self.echo_texts[index] or ""
                choices.append(
                    {
                        "index": index,
                        "text": echo + text,
                        "logprobs": self._logprobs(logprobs, len(echo)),
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
