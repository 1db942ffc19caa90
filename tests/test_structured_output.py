"""Structured output in the engine (issue 34), on a tiny random Llama with a byte-level tokenizer.

A constrained request's output parses and validates against its schema, greedy or sampled; its
grammar compiles off the engine thread while the request waits in the queue (other requests keep
running); compiled grammars are cached per schema; aborts, preemption and session turns work as for
any request; the mask touches only its own row. A property test draws random JSON schemas: every
output validates (jsonschema), and every instance of the schema is accepted by the grammar, written
as the engine writes JSON (an object's properties in the schema's order). (The instances come from `instances` below rather than
hypothesis-jsonschema, whose object strategy calls a Hypothesis internal that Hypothesis 6.170 no
longer has.)
"""

from __future__ import annotations

import json
import threading

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import LLM, InvalidRequestError, SamplingParams
from kvserve.errors import EngineError
from kvserve.structured_output import StructuredOutput
from tests.conftest import wait_idle_and_check
from tests.test_batch_invariance import at_once

CITY = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "London", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days", "metric"],
    "additionalProperties": False,
}
# Random weights wander; these biases make closing a string, an array or an object likely, so that
# outputs end well within max_tokens (the byte-level vocabulary: token id = byte).
CLOSING = {ord('"'): 10.0, ord("]"): 6.0, ord("}"): 6.0}


def constrained(schema, **overrides) -> SamplingParams:
    options = dict(max_tokens=96, temperature=0, structured_output=StructuredOutput.json_schema(schema))
    return SamplingParams(**{**options, **overrides})


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    with LLM(str(tiny_model_dir), dtype="float32", kv_cache_tokens=4096, progress=False, session_db=False) as llm:
        yield llm


@pytest.fixture(autouse=True)
def no_leaks(request):
    yield
    if "llm" in request.fixturenames:
        wait_idle_and_check(request.getfixturevalue("llm"))


@pytest.mark.parametrize("seed", [None, 1, 2], ids=["greedy", "seed1", "seed2"])
def test_output_validates_against_its_schema(llm, seed):
    params = constrained(CITY, temperature=0 if seed is None else 1.0, seed=seed)
    result = llm.generate("Plan a trip:", params)
    assert result.finish_reason == "stop"
    jsonschema.validate(json.loads(result.text), CITY)


def test_json_object_and_a_regex(llm):
    result = llm.generate(
        "x",
        SamplingParams(
            max_tokens=64, temperature=0, structured_output=StructuredOutput.json_object(), logit_bias=CLOSING
        ),
    )
    assert result.finish_reason == "stop" and isinstance(json.loads(result.text), dict)
    result = llm.generate(
        "x", SamplingParams(max_tokens=64, temperature=0, structured_output=StructuredOutput.regex(r"[a-c]{3}-\d\d"))
    )
    assert result.finish_reason == "stop"
    assert (
        len(result.text) == 6
        and set(result.text[:3]) <= set("abc")
        and result.text[3] == "-"
        and result.text[4:].isdigit()
    )


def test_a_streamed_constrained_request_equals_the_whole_one(llm):
    params = constrained(CITY, temperature=0.9, seed=5)
    whole = llm.generate("Plan a trip:", params)
    chunks = list(llm.stream("Plan a trip:", params))
    assert "".join(c.text for c in chunks) == whole.text and chunks[-1].finish_reason == "stop"


def test_the_grammar_ends_the_request_even_with_ignore_eos(llm):
    result = llm.generate("x", constrained(CITY, ignore_eos=True))
    assert result.finish_reason == "stop"
    jsonschema.validate(json.loads(result.text), CITY)


def test_a_grammar_that_the_last_allowed_token_completes_stops_the_request(llm):
    """An answer whole at exactly max_tokens stopped: "stop", so that OpenAI's parse() takes it; a token
    fewer leaves it unfinished ("length")."""
    whole = llm.generate("Plan a trip:", constrained(CITY))
    n = len(whole.token_ids)
    exact = llm.generate("Plan a trip:", constrained(CITY, max_tokens=n))
    assert (exact.text, exact.finish_reason) == (whole.text, "stop")
    short = llm.generate("Plan a trip:", constrained(CITY, max_tokens=n - 1))
    assert short.finish_reason == "length" and whole.text.startswith(short.text)
    regex = StructuredOutput.regex(r"[a-c]{3}-[0-9]{2}")  # six bytes: six tokens of the byte-level vocabulary
    six = llm.generate("x", SamplingParams(max_tokens=6, temperature=0, structured_output=regex))
    assert (len(six.text), six.finish_reason) == (6, "stop")


def test_the_mask_changes_only_its_own_row(llm):
    """Greedy unconstrained requests batched with constrained ones keep their solo tokens, and the
    constrained ones theirs."""
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [f"prompt number {i}" for i in range(8)]
    params = [constrained(CITY) if i % 2 else free for i in range(8)]
    solo = [llm.generate(p, s).token_ids for p, s in zip(prompts, params, strict=True)]
    assert at_once(llm, prompts, params) == solo


def test_a_request_waits_in_the_queue_while_its_grammar_compiles(llm, monkeypatch):
    """The compile is held: the constrained request waits (not scheduled) while an unconstrained one
    runs to its end; released, it runs, and a second request of the same schema compiles nothing."""
    grammars = llm.engine.grammars
    release, compiling = threading.Event(), threading.Event()
    compile_original = grammars._compile

    def held(grammar):
        compiling.set()
        assert release.wait(60)
        return compile_original(grammar)

    monkeypatch.setattr(grammars, "_compile", held)
    schema = {**CITY, "title": "held"}  # a grammar not cached yet
    stream = llm.stream("Plan a trip:", constrained(schema))
    first: list = []
    reader = threading.Thread(target=lambda: first.extend(stream))
    reader.start()
    assert compiling.wait(60)  # the stream submits from the reader thread: in the engine before `other`
    other = llm.generate("unconstrained", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert other.finish_reason == "length"
    counts = llm.check_integrity()
    assert counts["waiting"] == 1 and counts["running"] == 0 and not first  # queued, never in a step
    compiled = grammars.num_compiled
    release.set()
    reader.join(60)
    assert first[-1].finish_reason == "stop"
    again = llm.generate("Plan a trip:", constrained(schema))
    assert grammars.num_compiled == compiled + 1  # the held one; the second found it cached
    assert again.text == "".join(c.text for c in first)


def test_abort_while_the_grammar_compiles(llm, monkeypatch):
    grammars = llm.engine.grammars
    release = threading.Event()
    compile_original = grammars._compile
    monkeypatch.setattr(grammars, "_compile", lambda g: release.wait(60) and compile_original(g))
    stream = llm.stream("x", constrained({**CITY, "title": "aborted"}), request_id="held-grammar")
    chunks: list = []
    reader = threading.Thread(target=lambda: chunks.extend(stream))
    reader.start()
    while llm.check_integrity()["waiting"] == 0:
        pass
    llm.abort("held-grammar")
    reader.join(60)
    assert chunks[-1].finish_reason == "abort"
    release.set()


def test_a_grammar_that_fails_to_compile_fails_only_its_request(llm, monkeypatch):
    grammars = llm.engine.grammars

    def broken(grammar):
        raise RuntimeError("compiler bug")

    monkeypatch.setattr(grammars, "_compile", broken)
    with pytest.raises(InvalidRequestError, match="cannot be used"):
        llm.generate("x", constrained({**CITY, "title": "broken"}))
    monkeypatch.undo()
    assert llm.generate("x", SamplingParams(max_tokens=4, temperature=0)).finish_reason is not None


PAST_THE_LIMITS = {  # each compiles, then passes the grammar engine's limits at its first token or "{"
    "700 optional properties": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(700)}},
    "required recursion": {
        "$defs": {"N": {"type": "object", "properties": {"c": {"$ref": "#/$defs/N"}}, "required": ["c"]}},
        "$ref": "#/$defs/N",
    },
}


@pytest.mark.parametrize("name", PAST_THE_LIMITS)
def test_a_grammar_past_the_engines_limits_at_its_start_is_refused_before_any_output(llm, name):
    """Refused as the request's own mistake (a 400 over HTTP), in a sentence rather than the grammar
    engine's parser state (tens of KB), while a request beside it runs to its end."""
    beside = llm.stream("x", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    first = next(beside)  # it runs, before and after the refusal
    with pytest.raises(InvalidRequestError, match="grammar cannot be used") as refused:
        llm.generate("x", constrained(PAST_THE_LIMITS[name]))
    assert refused.value.param == "response_format" and len(str(refused.value)) < 500, str(refused.value)
    assert "<state>" not in str(refused.value)
    assert len(first.token_ids) + sum(len(chunk.token_ids) for chunk in beside) == 12


def test_a_grammar_failing_mid_answer_names_its_cause_in_one_line():
    """Past the grammar engine's limits mid-answer: the request's own error (the schema must be simpler),
    without the parser state llguidance appends; any other failure is the engine's."""
    from kvserve.engine.grammar import grammar_failure

    state = "\n<state>\n" + "x" * 50_000
    limit = grammar_failure("Parser Error: Current row has 2799 items; max is 2000" + state, "tools")
    assert isinstance(limit, InvalidRequestError) and limit.param == "tools" and "simplify" in str(limit)
    assert "2799 items" in str(limit) and len(str(limit)) < 500
    other = grammar_failure("token not allowed" + state, "response_format")
    assert type(other) is EngineError and len(str(other)) < 500
    unmatched = grammar_failure("Parser Error: NoExtensionBias" + state, "response_format")  # the schema's part
    assert isinstance(unmatched, InvalidRequestError) and "no value matches" in str(unmatched)


def test_preempted_constrained_requests_give_their_solo_outputs(tiny_model_dir, llm):
    """A tight pool preempts and recomputes: the grammar state carries over (the output tokens stay)."""
    digits = {"type": "integer", "minimum": 0, "maximum": 9}
    schema = {"type": "array", "items": digits, "minItems": 30, "maxItems": 30}  # 92 tokens
    params = [constrained(schema, max_tokens=100, temperature=1.0, seed=i) for i in range(6)]
    prompts = [f"preempted request {i}" for i in range(6)]
    solo = [llm.generate(p, s).token_ids for p, s in zip(prompts, params, strict=True)]
    with LLM(
        str(tiny_model_dir), dtype="float32", kv_cache_tokens=128, block_size=8, progress=False, session_db=False
    ) as tight:
        results = [None] * 6

        def run(i):
            results[i] = tight.generate(prompts[i], params[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert tight.stats()["num_preemptions_total"] > 0, "the pool was not tight enough to preempt"
        wait_idle_and_check(tight)
    assert [r.token_ids for r in results] == solo
    for r in results:
        assert r.finish_reason == "stop"
        jsonschema.validate(json.loads(r.text), schema)


def test_a_session_turn_is_constrained(tiny_model_dir, tmp_path):
    with LLM(
        str(tiny_model_dir), dtype="float32", kv_cache_tokens=4096, progress=False, session_db=tmp_path / "s.db"
    ) as llm:
        with llm.session() as session:
            session.add_message("user", "Plan a trip")
            turn = session.generate(constrained(CITY))
            jsonschema.validate(json.loads(turn.text), CITY)
            assert turn.text == llm.chat([{"role": "user", "content": "Plan a trip"}], constrained(CITY)).text
        wait_idle_and_check(llm)


def test_logit_bias_bans_and_forces_tokens(llm):
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first = llm.generate("bias", greedy).token_ids
    banned = llm.generate(
        "bias", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias={first[0]: -100})
    )
    assert banned.token_ids[0] != first[0]
    forced = llm.generate(
        "bias", SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True, logit_bias={ord("z"): 100})
    )
    assert forced.text == "zzzzzz"
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        llm.generate("bias", SamplingParams(logit_bias={10**6: 1.0}))  # outside the vocabulary


def _deep(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


DEEP = _deep(3000)


@pytest.mark.parametrize(
    "schema, match",
    [
        ({"type": "objekt"}, "invalid"),
        ({"type": "string", "pattern": "(a"}, "invalid"),
        ({"not": {"type": "string"}}, "does not support"),
        ({"$ref": "#/$defs/missing"}, "invalid"),
        (False, "no output matches"),
        ("{not json", "not valid JSON"),
        ({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}, "use anyOf"),  # not llguidance's option
        ({"enum": ["x" * 1000] * 100}, "more than"),
        (DEEP, "too deeply"),  # deeper than Python's stack: never a RecursionError
        ('{"a":' * 2000 + "1" + "}" * 2000, "too deeply"),  # as text: deeper than json.loads goes
        (
            {"type": "number", "exclusiveMinimum": 2, "exclusiveMaximum": 2.5},
            r"#: exclusiveMinimum 2 with a maximum below 3 .* let 2 itself",
        ),
        (
            {"properties": {"x": {"exclusiveMinimum": -0.5, "exclusiveMaximum": 0}}},
            "#/properties/x: exclusiveMaximum 0 .* let -0 itself",
        ),
        # references that only lead back to themselves: at the start they passed the engine's limits; reached
        # mid-answer (after another property), the grammar engine failed there, a 500
        (
            {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"},
            "loop of references",
        ),
        (
            {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "a": {"$ref": "#/$defs/A"}},
                "required": ["x", "a"],
                "$defs": {"A": {"$ref": "#/$defs/A"}},
            },
            "#/[$]defs/A -> #/[$]defs/A is a loop",
        ),
        # held at 2**63 - 1, the output fell outside the range; or refused as "invalid or unsatisfiable"
        ({"type": "integer", "minimum": 10**30, "maximum": 10**30 + 5}, "#: minimum 1000.* beyond the bounds"),
        ({"type": "integer", "minimum": -(2**63)}, "beyond the bounds"),
        ({"type": "number", "minimum": 1e18}, "cannot hold a number bound"),
    ],
    ids=[
        "bad-type",
        "bad-pattern",
        "unsupported",
        "dangling-ref",
        "false",
        "not-json",
        "one-of",
        "too-large",
        "deep",
        "deep-text",
        "excluded-integer",
        "excluded-minus-zero",
        "reference-loop",
        "reference-loop-mid-answer",
        "integer-beyond-64-bits",
        "minimum-of-int64",
        "float-bound",
    ],
)
def test_bad_schemas_are_refused_when_made(schema, match):
    with pytest.raises(InvalidRequestError, match=match):
        StructuredOutput.json_schema(schema)


def test_what_a_grammar_cannot_combine_with_is_refused():
    grammar = StructuredOutput.json_object()
    for conflict in (dict(stop=["}"]), dict(stop_token_ids=[5]), dict(min_tokens=2)):
        with pytest.raises(InvalidRequestError, match="cannot be combined with structured output, here from resp"):
            SamplingParams(structured_output=grammar, **conflict)
    calls = StructuredOutput.json_schema({"type": "object"}, "tools", "tool_calls")  # the message says why
    with pytest.raises(InvalidRequestError, match="here from tools whose calls a grammar writes"):
        SamplingParams(structured_output=calls, stop=["x"])
    with pytest.raises(InvalidRequestError, match="logit_bias values"):
        SamplingParams(logit_bias={1: 101})


def test_a_recursive_schema_compiles(llm):
    tree = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "v": {"type": "integer", "minimum": 0, "maximum": 9},
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                },
                "required": ["v", "kids"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/node",
    }
    result = llm.generate("tree", constrained(tree, max_tokens=200, logit_bias=CLOSING))
    if result.finish_reason == "stop":
        jsonschema.validate(json.loads(result.text), tree)
    else:
        assert result.finish_reason == "length"


# ----- random schemas ------------------------------------------------------------------------
_NAMES = st.text("abcdefghij_", min_size=1, max_size=6)
_SCALARS = st.one_of(
    st.builds(lambda: {"type": "boolean"}),
    st.builds(lambda: {"type": "null"}),
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-1000, 1000),
        st.integers(0, 500),
    ),
    st.builds(lambda: {"type": "number"}),
    st.builds(
        lambda lo, extra: {"type": "string", "minLength": lo, "maxLength": lo + extra},
        st.integers(0, 3),
        st.integers(0, 6),
    ),
    st.builds(
        lambda p: {"type": "string", "pattern": p},
        st.sampled_from([r"^[a-z]{1,4}$", r"^[0-9]{2}-[0-9]{2}$", r"^(yes|no)$"]),
    ),
    st.builds(
        lambda values: {"enum": values},
        st.lists(st.one_of(st.integers(-9, 9), _NAMES, st.booleans()), min_size=1, max_size=4, unique=True),
    ),
    st.builds(lambda v: {"const": v}, st.one_of(st.integers(-9, 9), _NAMES)),
)


def _object(members: dict, required_flags: list[bool]) -> dict:
    names = list(members)
    return {
        "type": "object",
        "properties": members,
        "required": [n for n, flag in zip(names, required_flags, strict=False) if flag],
        "additionalProperties": False,
    }


SCHEMAS = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.builds(
            _object,
            st.dictionaries(_NAMES, inner, min_size=1, max_size=4),
            st.lists(st.booleans(), min_size=4, max_size=4),
        ),
        st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, inner, st.integers(0, 3)),
        st.builds(lambda a, b: {"anyOf": [a, b]}, inner, inner),
    ),
    max_leaves=6,
)


@settings(  # a fixed sequence of examples (derandomized): the suite's outcome does not vary by run
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(schema=SCHEMAS, seed=st.integers(0, 2**16), data=st.data())
def test_random_schemas_outputs_validate_and_instances_are_accepted(llm, schema, seed, data):
    spec = StructuredOutput.json_schema(schema)
    params = SamplingParams(max_tokens=160, temperature=1.0, seed=seed, structured_output=spec, logit_bias=CLOSING)
    result = llm.generate("{", params)
    assert result.finish_reason in ("stop", "length")
    if result.finish_reason == "stop":
        jsonschema.validate(json.loads(result.text), schema)
    # The other direction: any instance, written as the engine writes JSON, is one the grammar allows.
    instance = data.draw(instances(schema), label="instance")
    # (llguidance writes DEL escaped, as \u007f, and takes it only so; JSON allows it either way)
    text = json.dumps(instance, ensure_ascii=False, separators=(", ", ": ")).replace("\x7f", "\\u007f")
    matcher = _matcher(llm, spec)
    assert matcher.consume_tokens(llm.tokenizer.encode(text, add_special_tokens=False)), matcher.get_error()
    assert matcher.is_accepting(), text


def instances(schema: dict) -> st.SearchStrategy:
    """Values valid against a schema drawn from SCHEMAS."""
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "anyOf" in schema:
        return st.one_of(*(instances(s) for s in schema["anyOf"]))
    kind = schema["type"]
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "integer":
        return st.integers(schema["minimum"], schema["maximum"])
    if kind == "number":
        return st.floats(allow_nan=False, allow_infinity=False, width=32)
    if kind == "string":
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True)
        return st.text(min_size=schema["minLength"], max_size=schema["maxLength"])
    if kind == "array":
        return st.lists(instances(schema["items"]), max_size=schema["maxItems"])
    required = schema["required"]

    @st.composite
    def objects(draw):
        names = [n for n in schema["properties"] if n in required or draw(st.booleans())]  # the schema's order
        return {n: draw(instances(schema["properties"][n])) for n in names}

    return objects()


def _matcher(llm, spec):
    import llguidance

    return llguidance.LLMatcher(llm.engine.grammars.ll_tokenizer(), spec.grammar, log_level=0)


def test_the_mask_kernel_and_its_pytorch_form_equal_a_plain_reference(extension):
    """Token t is allowed by bit t % 32 of word t // 32; ids past the mask are forbidden; rows
    without a mask are untouched."""
    import torch

    from kvserve.engine.sampler import bitmask_bias
    from kvserve.kernels import ops

    generator = torch.Generator().manual_seed(0)
    vocab, words = 32 * 5 - 7, 4  # the mask covers 128 of 153 ids
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=generator)
    bitmask[1] = -1  # a row that allows every id the mask covers
    logits = torch.randn(5, vocab, generator=generator)
    rows = [0, 2, 4]
    expected = logits.clone()
    for i, row in enumerate(rows):
        for t in range(vocab):
            word = t // 32
            if word >= words or not (int(bitmask[i, word]) >> (t % 32)) & 1:
                expected[row, t] = float("-inf")
    kernel = logits.clone()
    ops.apply_token_bitmask(kernel, torch.tensor(rows), bitmask)
    assert torch.equal(kernel, expected)
    pytorch = logits.clone()
    pytorch[rows] += bitmask_bias(bitmask, vocab)
    assert torch.equal(pytorch, expected)
