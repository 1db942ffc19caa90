"""Grammars of constrained requests: compiled off the engine thread, masks filled on it.

`Grammars` belongs to the engine. A request with `params.structured_output` gets a `Grammar` when it
is admitted; its grammar text is compiled on a small thread pool (llguidance's matcher; cached per
grammar text, so a schema seen before costs a copy) and the request waits in the scheduler's queue
until then: the scheduler skips a request whose grammar is not ready, and never waits for one.

Each step, before the runner starts it, `fill_masks` computes the bitmask of every constrained row
that samples (one bit per token id, int32 words, llguidance's layout) and hangs it on that row's
ScheduledRequest; the sampler sets the logits of the forbidden tokens of that row, and only that row,
to -inf. After the step, `advance` feeds the sampled token to the request's matcher. Preemption needs
nothing: a preempted request keeps its output tokens and its matcher, and recomputes only their KV.
A matcher goes with its request (`Request.grammar`), whichever way the request finishes.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import torch

from kvserve.engine.scheduler import SchedulerOutput
from kvserve.errors import EngineError, InvalidRequestError, KVServeError, first_line
from kvserve.structured_output import StructuredOutput, parser_limits
from kvserve.text.tokenizer import Tokenizer

MAX_CACHED_GRAMMARS = 256


class GrammarRefused(Exception):
    """The grammar engine refuses a request's grammar before its first token (the message says why)."""


_LIMITS = re.compile(r"limit|max is|too many|fuel", re.IGNORECASE)


def grammar_failure(why: str, param: str) -> KVServeError:
    """The error a request ends with when its grammar fails mid-answer: the request's own where its
    grammar needs more than the grammar engine's limits (a 400's kind: the schema must be simpler),
    else the engine's."""
    line = first_line(why, "the grammar failed")  # without the parser state llguidance appends
    if _LIMITS.search(line):
        return InvalidRequestError(
            f"The output's grammar needs more work per token than the grammar engine allows ({line}); simplify "
            "it: fewer optional properties, less nesting or recursion.",
            param,
        )
    if "NoExtensionBias" in line:  # llguidance's, on reaching a rule that no text can extend
        return InvalidRequestError(
            f"The output reached a part of the schema that no value matches ({line}); fix that part of the "
            "schema (a definition that is only references, say).",
            param,
        )
    return EngineError(f"The request's grammar failed ({line}); the request cannot continue.")


def grammar_param(request) -> str:
    """The field a request's grammar came from: its tools' or its response_format's."""
    spec = request.params.structured_output if request is not None else None
    return "tools" if spec is not None and spec.kind == "tool_calls" else "response_format"


class Grammar:
    """One request's grammar state. `is_ready` turns true on the engine thread once the compiled
    grammar is there (`take`); from then on the matcher follows the request's output tokens."""

    def __init__(self, compiled: Future) -> None:
        self.compiled = compiled  # of a pristine llguidance.LLMatcher, shared by every request of this grammar
        self.matcher: llguidance.LLMatcher | None = None
        self.is_ready = False

    def take(self) -> str | None:
        """On the engine thread, once compiled: this request's own matcher. Returns why the grammar
        cannot be used, or None."""
        try:
            pristine = self.compiled.result(timeout=0)
        except GrammarRefused as exc:
            return str(exc)
        except Exception as exc:  # compiling raised (a bug of ours or the library's): the request fails
            return f"compiling its grammar failed ({exc!r})"
        self.matcher = pristine.deep_copy()
        self.is_ready = True
        return None

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar refuses it (the matcher says why)."""
        return self.matcher.consume_token(token_id)

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and allows nothing more (the request ends here)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error() if self.matcher is not None else ""


class Grammars:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_workers: int = 1) -> None:
        """`vocab_size` is the width of the model's logits (it may exceed the tokenizer's)."""
        self.tokenizer = tokenizer
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)
        self.num_words = (self.vocab_size + 31) // 32
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="kvserve-grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Future] = OrderedDict()  # grammar text -> compiled, least recent first
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self.num_compiled = 0
        self.compile_seconds = 0.0
        self.num_mask_rows = 0  # rows masked, and the engine thread's seconds filling their masks
        self.mask_seconds = 0.0

    # ----- any thread ----------------------------------------------------------------------
    def start(self, spec: StructuredOutput, ready: Callable[[], None]) -> Grammar:
        """The request's Grammar, compiling `spec` on the pool unless cached; `ready()` is called (on
        the pool's thread, or now) once it is compiled, successfully or not."""
        with self._lock:
            compiled = self._cache.get(spec.grammar)
            if compiled is None:
                compiled = self._pool.submit(self._compile, spec.grammar)
                self._cache[spec.grammar] = compiled
                while len(self._cache) > MAX_CACHED_GRAMMARS:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(spec.grammar)
        compiled.add_done_callback(lambda _: ready())
        return Grammar(compiled)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ----- the pool's thread ---------------------------------------------------------------
    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        """A pristine matcher of `grammar`, or GrammarRefused: where it fails to compile, or on its
        first token or the tokens it forces (an object's "{"), the grammar engine's limits are past
        before any output (a definition that only refers to itself, hundreds of optional properties,
        a required recursion)."""
        started = time.perf_counter()
        try:
            matcher = llguidance.LLMatcher(self.ll_tokenizer(), grammar, log_level=0, limits=parser_limits())
            problem = matcher.get_error() if matcher.is_error() else self._first_steps_problem(matcher)
            if problem:
                with self._lock:  # not cached: the same text fails the same way, cheaply
                    self._cache.pop(grammar, None)
                raise GrammarRefused(first_line(problem, "the grammar failed"))
            return matcher
        finally:
            self.num_compiled += 1
            self.compile_seconds += time.perf_counter() - started

    def _first_steps_problem(self, pristine: llguidance.LLMatcher) -> str:
        probe = pristine.deep_copy()
        bitmask = torch.empty((1, self.num_words), dtype=torch.int32)
        probe.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * bitmask.element_size())
        if not probe.is_error():
            forced = probe.compute_ff_tokens()
            if forced and not probe.is_error():
                probe.consume_tokens(forced)
        return probe.get_error() if probe.is_error() else ""

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary (every token's bytes), built once on first use (~0.2 s
        for a 49k vocabulary): its end-of-sequence tokens are the model's stop tokens."""
        if self._ll_tokenizer is None:
            stops = list(self.tokenizer.stop_token_ids)
            self._ll_tokenizer = llguidance.LLTokenizer(
                self.tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=stops or None
            )
        return self._ll_tokenizer

    # ----- the engine thread ---------------------------------------------------------------
    def fill_masks(self, out: SchedulerOutput) -> list[tuple[str, str]]:
        """Hang a token bitmask on each row of `out` that samples under a grammar. Returns (request
        id, why) for rows whose grammar failed here (it hit the engine's limits)."""
        rows = []
        for item in out.scheduled:
            grammar = out.requests[item.request_id].grammar
            if grammar is not None and item.sample:
                rows.append((item, grammar.matcher))
        if not rows:
            return []
        started = time.perf_counter()
        failed = []
        for item, matcher in rows:
            # One row at a time on this thread: llguidance's parallel executor was slower here, its
            # threads competing with the OpenMP threads that spin after a step (bench/results/structured.json).
            # The matcher writes the words in place (what llguidance.torch.fill_next_token_bitmask does;
            # that module is not imported: its torch.compile decorator costs every start ~2 s and imports triton).
            bitmask = torch.empty((1, self.num_words), dtype=torch.int32)
            matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * bitmask.element_size())
            if matcher.is_error():
                failed.append((item.request_id, matcher.get_error()))
            item.token_bitmask = bitmask[0]
        self.num_mask_rows += len(rows)
        self.mask_seconds += time.perf_counter() - started
        return failed
