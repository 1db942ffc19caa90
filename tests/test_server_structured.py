"""Structured output and tool calls over the OpenAI API (issue 34), with the official openai client
against `kvserve serve`'s app (the engine in a process of its own): `parse()` with a pydantic model,
response_format on every route, streamed or not; a tool loop (call -> result -> answer) on the
bundled SmolLM2 (the generic format) and on a tiny random Qwen2 with a Qwen2.5-style template (the
Hermes format; random weights call only when constrained, which is what is tested there); streamed
tool-call deltas reassembled into the whole answer; bad input answered 400, never a hang or a 500.
"""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from kvserve.server.app import ServerSettings, create_app
from tests.conftest import wait_idle_and_check
from tests.server_harness import serving
from tests.test_tool_calls import QWEN_TEMPLATE, write_tokenizer

pytestmark = pytest.mark.bundled

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
FORECAST = {
    "type": "function",
    "function": {
        "name": "get_forecast",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population: int = Field(ge=0, le=100_000_000)  # unbounded, a 135M model may write digits until max_tokens


def _serve(model, tmp_path, name):
    settings = ServerSettings(
        model=str(model),
        served_model_name=name,
        kv_cache_tokens=8192,
        max_num_seqs=16,
        session_db=str(tmp_path / "sessions.db"),
    )
    app = create_app(settings)
    return app, serving(app)


@pytest.fixture(scope="module")
def smol(bundled_gguf, tmp_path_factory):
    app, server = _serve(bundled_gguf, tmp_path_factory.mktemp("smol"), "smol")
    with server as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0), base
        wait_idle_and_check(app.state.kvserve.llm)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    import torch

    path = tmp_path_factory.mktemp("tiny-qwen2")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,  # a byte per token: the template's tool prompt alone is ~1000
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    transformers.Qwen2ForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, QWEN_TEMPLATE)  # <tool_call> and </tool_call> as added tokens, as Qwen2.5's
    app, server = _serve(path, tmp_path_factory.mktemp("qwen-sessions"), "qwen")
    with server as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        wait_idle_and_check(app.state.kvserve.llm)


def test_parse_returns_a_validating_object(smol):
    client, _ = smol
    messages = [{"role": "user", "content": "Describe Paris as JSON."}]
    result = client.chat.completions.parse(
        model="smol", messages=messages, response_format=City, temperature=0, max_tokens=64
    )
    choice = result.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, City)
    jsonschema.validate(json.loads(choice.message.content), City.model_json_schema())


def test_response_format_on_completions_streams_and_sessions(smol):
    client, base = smol
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 30}, "sure": {"type": "boolean"}},
        "required": ["answer", "sure"],
        "additionalProperties": False,
    }
    json_schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    completion = client.completions.create(
        model="smol",
        prompt="The capital of France is",
        max_tokens=48,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert isinstance(json.loads(completion.choices[0].text), dict)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    stream = client.chat.completions.create(
        model="smol",
        messages=messages,
        response_format=json_schema,
        temperature=0.7,
        seed=3,
        max_tokens=48,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), schema)
    session = httpx.post(f"{base}/v1/sessions", json={"system": "Answer in JSON."}).json()
    httpx.post(f"{base}/v1/sessions/{session['id']}/messages", json={"role": "user", "content": messages[0]["content"]})
    turn = httpx.post(
        f"{base}/v1/sessions/{session['id']}/completions",
        json={"max_tokens": 48, "temperature": 0, "response_format": json_schema},
        timeout=120,
    ).json()
    jsonschema.validate(json.loads(turn["choices"][0]["message"]["content"]), schema)
    httpx.delete(f"{base}/v1/sessions/{session['id']}")


def _reassemble(stream) -> tuple[str | None, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish_reason) from streamed chunks, checking OpenAI's order: a
    call's id and name first (arguments ""), then only pieces of its arguments."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            if delta.index not in calls:
                assert delta.id and delta.id.startswith("call_") and delta.function.name and delta.type == "function"
                assert delta.function.arguments == ""
                calls[delta.index] = [delta.function.name, ""]
            else:
                assert delta.id is None and delta.function.name is None
                calls[delta.index][1] += delta.function.arguments
        finish = choice.finish_reason or finish
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish


def _calls(message) -> list[tuple[str, str]]:
    return [(call.function.name, call.function.arguments) for call in message.tool_calls or []]


def test_a_tool_loop_on_the_bundled_model(smol):
    client, _ = smol
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(
        model="smol", messages=messages, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=60
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    result = {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})}
    messages += [choice.message.model_dump(exclude_none=True), result]
    answer = client.chat.completions.create(
        model="smol", messages=messages, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=40
    )
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    alone = client.chat.completions.create(
        model="smol", messages=messages[:1], tool_choice="none", tools=[WEATHER], max_tokens=1
    )
    assert answer.usage.prompt_tokens > alone.usage.prompt_tokens + 20  # the call and its result went back in
    auto = client.chat.completions.create(
        model="smol", messages=messages, tools=[WEATHER], temperature=0, max_tokens=60
    )
    assert auto.choices[0].finish_reason in (
        "tool_calls",
        "stop",
    )  # generic auto: a call or an answer, valid either way
    if auto.choices[0].finish_reason == "stop":
        assert auto.choices[0].message.content and not auto.choices[0].message.tool_calls


class Item(BaseModel):
    sku: Literal["a1", "b2", "c3"]
    qty: int = Field(ge=1, le=9)


class Order(BaseModel):
    items: list[Item] = Field(min_length=1, max_length=3)


def test_a_pydantic_tool_with_a_nested_model(smol):
    """openai.pydantic_function_tool writes the nested model into $defs and refers to it: every such
    tool was answered 400 before (the grammar embedded the parameters where their $ref failed)."""
    client, _ = smol
    tool = openai.pydantic_function_tool(Order)
    assert "$defs" in tool["function"]["parameters"]
    completion = client.chat.completions.parse(
        model="smol",
        messages=[{"role": "user", "content": "Order two a1 and one c3."}],
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,  # else this small model calls again and again, until max_tokens
        temperature=0,
        max_tokens=120,
    )
    (call,) = completion.choices[0].message.tool_calls
    assert call.function.name == "Order"
    assert isinstance(call.function.parsed_arguments, Order)  # the client validated it with the model


def test_streamed_tool_call_deltas_reassemble_into_the_whole_answer(smol):
    client, _ = smol
    body = dict(
        model="smol",
        messages=[{"role": "user", "content": "Weather in Rome, please."}],
        tools=[WEATHER, FORECAST],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=80,
    )
    whole = client.chat.completions.create(**body).choices[0]
    content, calls, finish = _reassemble(client.chat.completions.create(stream=True, **body))
    assert (content, calls, finish) == (whole.message.content, _calls(whole.message), whole.finish_reason)
    assert finish == "tool_calls" and calls


def test_a_whole_answer_at_exactly_max_tokens_stops_and_a_call_cut_short_is_never_content(smol):
    """A call or an object whole at its last allowed token finishes "tool_calls" or "stop" (parse() takes
    it); a call cut short is "length" with no content, streamed or not (kvserve's wrapper never shows)."""
    client, _ = smol
    body = dict(
        model="smol",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
    )
    whole = client.chat.completions.create(max_tokens=60, **body)
    n = whole.usage.completion_tokens
    exact = client.chat.completions.create(max_tokens=n, **body).choices[0]
    assert (exact.finish_reason, _calls(exact.message)) == ("tool_calls", _calls(whole.choices[0].message))
    for cut in (1, 5, n - 1):
        choice = client.chat.completions.create(max_tokens=cut, **body).choices[0]
        assert (choice.finish_reason, choice.message.content) == ("length", None), cut
        streamed = _reassemble(client.chat.completions.create(max_tokens=cut, stream=True, **body))
        assert streamed == (None, _calls(choice.message), "length"), cut
    ask = dict(model="smol", messages=[{"role": "user", "content": "Describe Paris as JSON."}], temperature=0)
    parsed = client.chat.completions.parse(response_format=City, max_tokens=64, **ask)
    again = client.chat.completions.parse(response_format=City, max_tokens=parsed.usage.completion_tokens, **ask)
    assert (
        again.choices[0].finish_reason == "stop" and again.choices[0].message.parsed == parsed.choices[0].message.parsed
    )


def test_a_tool_loop_on_a_qwen_template(qwen):
    for choice in ("required", {"type": "function", "function": {"name": "get_forecast"}}):
        messages = [{"role": "user", "content": "Forecast for Rome?"}]
        body = dict(
            model="qwen",
            tools=[WEATHER, FORECAST],
            tool_choice=choice,
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=120,
        )
        first = qwen.chat.completions.create(messages=messages, **body).choices[0]
        assert first.finish_reason == "tool_calls"
        (call,) = first.message.tool_calls
        function = next(t["function"] for t in (WEATHER, FORECAST) if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), function["parameters"])
        if isinstance(choice, dict):
            assert call.function.name == "get_forecast"
        streamed = _reassemble(qwen.chat.completions.create(messages=messages, stream=True, **body))
        assert streamed == (first.message.content, _calls(first.message), "tool_calls")
        messages += [
            first.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        ]
        answer = qwen.chat.completions.create(messages=messages, **{**body, "tool_choice": "none", "max_tokens": 8})
        assert answer.choices[0].finish_reason in ("stop", "length") and not answer.choices[0].message.tool_calls


def test_required_calls_with_parallel_allowed_are_whole_and_valid(qwen):
    body = dict(
        model="qwen",
        messages=[{"role": "user", "content": "Both cities?"}],
        tools=[FORECAST],
        tool_choice="required",
        temperature=1.0,
        seed=11,
        max_tokens=200,
    )
    for seed in range(11, 14):  # as many calls as the model makes before it ends: each one whole and valid
        choice = qwen.chat.completions.create(**{**body, "seed": seed}).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), FORECAST["function"]["parameters"])


BAD = [
    (
        "chat",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
        "response_format.json_schema.schema",
    ),
    (
        "chat",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}},
            }
        },
        "response_format.json_schema.schema",
    ),
    (
        "chat",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["y" * 70_000]}}}},
        "response_format.json_schema.schema",
    ),
    (
        "chat",
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
        "response_format.json_schema",
    ),
    ("chat", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("chat", {"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),  # unknown
    (
        "chat",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "stric": True}}},
        "response_format.json_schema.stric",
    ),
    ("chat", {"response_format": {"type": "json_object"}, "stop": ["}"]}, "stop"),
    ("chat", {"tools": [WEATHER], "stop": ["}"]}, "stop"),  # auto, but the generic format's calls are a grammar's
    ("chat", {"response_format": {"type": "json_object"}, "tools": [WEATHER]}, "response_format"),
    (
        "chat",
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}},
                    },
                }
            ]
        },
        "tools[0].function.parameters",
    ),
    ("chat", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("chat", {"logit_bias": {"5": 500}}, "logit_bias"),
    ("chat", {"logit_bias": {"9999999": 1}}, "logit_bias"),
    ("chat", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    (
        "chat",
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}],
                }
            ]
        },
        "messages[0].tool_calls[0].function.arguments",
    ),
    (  # JSON, but not an object
        "chat",
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}}],
                }
            ]
        },
        "messages[0].tool_calls[0].function.arguments",
    ),
    (  # a result for a call no assistant message made (OpenAI: 400)
        "chat",
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                },
                {"role": "tool", "tool_call_id": "c2", "content": "x"},
            ]
        },
        "messages[2].tool_call_id",
    ),
    (
        "chat",
        {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "c", "content": "x"}]},
        "messages[1].tool_call_id",
    ),
    (
        "completions",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": False}}},
        "response_format.json_schema.schema",
    ),
]


@pytest.mark.parametrize("route, extra, param", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_bad_input_is_a_400_naming_the_field(smol, route, extra, param, stream):
    _, base = smol
    body = {"model": "smol", "max_tokens": 4, "stream": stream, **extra}
    if route == "chat":
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
    else:
        body["prompt"] = "hi"
    response = httpx.post(f"{base}/v1/{'chat/' if route == 'chat' else ''}completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert len(error["message"]) > 20


def test_a_grammar_the_engine_refuses_names_its_field_streamed_too(smol):
    """Refused by the grammar engine, not by the edge (past its limits at the first token): the same
    error unstreamed and as a stream's error event, which said `param: null`."""
    _, base = smol
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(700)}}
    body = {
        "model": "smol",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "wide", "schema": wide}},
    }
    whole = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
    assert whole.status_code == 400, whole.text
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as streamed:
        events = [line[6:] for line in streamed.iter_lines() if line.startswith("data: ")]
    error = json.loads(events[-2])["error"] if streamed.status_code == 200 else streamed.json()["error"]
    assert error == whole.json()["error"], (error, whole.json())
