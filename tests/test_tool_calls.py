"""Tool calls (issue 34, 3): formats from the chat template, tools rendered as transformers renders
them, grammars that accept exactly a call of the named functions, and the parser: content and calls
from an answer, the same whether it arrives whole or in any pieces.

The Qwen2.5-style template below is the Hermes tool format that Qwen2.5 and Qwen3 publish; the
Llama 3.1-style one renders tools into the first user message as Llama 3.1's does.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import llguidance
import pytest

from kvserve import InvalidRequestError
from kvserve.text import tool_calls
from kvserve.text.tokenizer import Tokenizer
from kvserve.text.tool_calls import ToolChoice, ToolFormat, parse

QWEN_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
    {%- if loop.first and tools is not none and tools and message.role == 'user' %}
        {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
        {{- "Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\\n\\n" }}
        {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
        {{- "Do not use variables.\\n\\n" }}
        {%- for t in tools %}
            {{- t | tojson(indent=4) }}
            {{- "\\n\\n" }}
        {%- endfor %}
        {{- message.content + '<|eot_id|>' }}
    {%- elif message.tool_calls %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", "parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {{- message.content + "<|eot_id|>" }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def write_tokenizer(path: Path, template: str, extra: tuple[str, ...] = ("<tool_call>", "</tool_call>")) -> None:
    """A byte-level BPE tokenizer with ChatML's special tokens and, as Qwen2.5 has them, <tool_call>
    and </tool_call> as ordinary added tokens."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    from kvserve.text.tokenizer import _byte_alphabet

    vocab = {char: byte for byte, char in _byte_alphabet().items()}
    backend = Backend(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra])
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "bos_token": None, "chat_template": template}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def qwen_tokenizer(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen-tokenizer")
    write_tokenizer(path, QWEN_TEMPLATE)
    return path


CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 1}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'},
    {"role": "tool", "tool_call_id": "call_2", "content": '{"sky": "rain"}'},
]


def _as_transformers_takes_it(messages):
    """What a client of transformers passes: arguments as objects."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def test_formats_come_from_the_template(qwen_tokenizer, tmp_path, bundled_gguf):
    assert tool_calls.detect_format(Tokenizer.from_folder(qwen_tokenizer)) is ToolFormat.HERMES
    write_tokenizer(tmp_path / "llama", LLAMA3_TEMPLATE)
    assert tool_calls.detect_format(Tokenizer.from_folder(tmp_path / "llama")) is ToolFormat.LLAMA3
    assert tool_calls.detect_format(Tokenizer.from_gguf(bundled_gguf)) is ToolFormat.GENERIC  # SmolLM2


@pytest.mark.parametrize("template", ["qwen", "llama3"])
def test_tools_and_tool_messages_render_as_transformers_renders_them(qwen_tokenizer, tmp_path, template):
    transformers = pytest.importorskip("transformers")
    path = qwen_tokenizer
    messages = CONVERSATION
    if template == "llama3":
        path = tmp_path / "llama"
        write_tokenizer(path, LLAMA3_TEMPLATE)
        messages = [*[m for m in CONVERSATION if m["role"] != "system"][:3], CONVERSATION[3]]
        messages[1] = {**messages[1], "tool_calls": messages[1]["tool_calls"][:1]}
    ours = Tokenizer.from_folder(path)
    choice = ToolChoice.from_request([WEATHER, TIME], "auto", None)
    fmt = tool_calls.detect_format(ours)
    rendered, variables = tool_calls.render_inputs(messages, choice, fmt, ours)
    text = ours.apply_chat_template(rendered, **variables)
    reference = transformers.AutoTokenizer.from_pretrained(path)
    expected = reference.apply_chat_template(
        _as_transformers_takes_it(messages), tools=[WEATHER, TIME], add_generation_prompt=True, tokenize=False
    )
    assert text == expected
    assert '"name": "get_time"' in text and '{"sky": "sunny"}' in text


def test_the_generic_format_describes_the_tools_in_a_system_message(bundled_gguf):
    tokenizer = Tokenizer.from_gguf(bundled_gguf)
    choice = ToolChoice.from_request([WEATHER], "required", None)
    rendered, variables = tool_calls.render_inputs(CONVERSATION, choice, ToolFormat.GENERIC, tokenizer)
    assert variables == {}  # SmolLM2's template renders no tools: kvserve says them itself
    assert rendered[0]["role"] == "system" and rendered[0]["content"].startswith("You are terse.\n\n")
    assert '"get_weather"' in rendered[0]["content"] and '{"tool_calls": [' in rendered[0]["content"]
    assert json.loads(rendered[2]["content"])["tool_calls"][1] == {
        "name": "get_weather",
        "arguments": {"city": "Rome", "days": 1},
    }
    assert rendered[3]["role"] == "tool" and json.loads(rendered[3]["content"])["name"] == "get_weather"


def _accepts(tokenizer: Tokenizer, grammar, text: str) -> bool:
    ll = llguidance.LLTokenizer(tokenizer.backend.to_str(), eos_token=list(tokenizer.stop_token_ids))
    matcher = llguidance.LLMatcher(ll, grammar.grammar, log_level=0)
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


def test_grammars_accept_exactly_calls_of_the_named_functions(qwen_tokenizer, bundled_gguf):
    qwen = Tokenizer.from_folder(qwen_tokenizer)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}\n</tool_call>'
    required = tool_calls.grammar(ToolChoice.from_request([WEATHER, TIME], "required", None), ToolFormat.HERMES, qwen)
    assert _accepts(qwen, required, call)
    assert _accepts(
        qwen,
        required,
        call + "\n" + call.replace("get_weather", "get_time").replace('{"city": "Rome", "days": 3}', "{}"),
    )
    assert not _accepts(qwen, required, call.replace("Rome", "Oslo"))  # not in the enum
    assert not _accepts(qwen, required, call.replace("3", "9"))  # above the maximum
    assert not _accepts(qwen, required, "Sure! " + call)
    single = tool_calls.grammar(ToolChoice.from_request([WEATHER, TIME], "required", False), ToolFormat.HERMES, qwen)
    assert not _accepts(qwen, single, call + "\n" + call)
    named = tool_calls.grammar(
        ToolChoice.from_request([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, None),
        ToolFormat.HERMES,
        qwen,
    )
    assert not _accepts(qwen, named, call)
    assert _accepts(qwen, named, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert tool_calls.grammar(ToolChoice.from_request([WEATHER], "auto", None), ToolFormat.HERMES, qwen) is None
    assert tool_calls.grammar(ToolChoice.from_request([WEATHER], "none", None), ToolFormat.GENERIC, qwen) is None
    llama = tool_calls.grammar(ToolChoice.from_request([WEATHER], "required", None), ToolFormat.LLAMA3, qwen)
    assert _accepts(qwen, llama, '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}')
    smol = Tokenizer.from_gguf(bundled_gguf)
    auto = tool_calls.grammar(ToolChoice.from_request([WEATHER], "auto", None), ToolFormat.GENERIC, smol)
    assert _accepts(smol, auto, '{"content": "It is sunny."}')
    assert _accepts(smol, auto, '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]}')
    assert not _accepts(smol, auto, '{"tool_calls": []}')


def test_parameters_that_are_only_a_reference_are_closed_as_their_definition(bundled_gguf):
    """pydantic writes a model with a recursive part as a root `$ref`: the type kvserve put beside it made
    the definition a part, left open, and the model wrote `{"a": 1, "type": "integer"}`."""
    smol = Tokenizer.from_gguf(bundled_gguf)
    definition = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    f = {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/P", "$defs": {"P": definition}}}}
    required = tool_calls.grammar(ToolChoice.from_request([f], "required", None), ToolFormat.GENERIC, smol)
    assert _accepts(smol, required, '{"tool_calls": [{"name": "f", "arguments": {"a": 1}}]}')
    assert not _accepts(smol, required, '{"tool_calls": [{"name": "f", "arguments": {"a": 1, "type": "integer"}}]}')


# As openai.pydantic_function_tool writes a model with a nested one: its parameters refer to their own
# $defs (and here to `definitions` and to their root too), which hold wherever the grammar embeds them.
ORDER = {
    "type": "function",
    "function": {
        "name": "place_order",
        "parameters": {
            "$defs": {
                "Item": {
                    "type": "object",
                    "properties": {"sku": {"enum": ["a1", "b2"]}, "qty": {"type": "integer", "minimum": 1}},
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                }
            },
            "definitions": {"Note": {"type": "string", "maxLength": 8}},
            "type": "object",
            "properties": {
                "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "minItems": 1},
                "note": {"$ref": "#/definitions/Note"},
                "then": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
            },
            "required": ["items", "note", "then"],
            "additionalProperties": False,
        },
    },
}


def test_tools_whose_parameters_refer_to_their_own_definitions(qwen_tokenizer, bundled_gguf):
    """Before, every such tool was refused ("Pointer '/$defs/Item' does not exist"): the grammar
    embeds the parameters below its own root, where their references no longer pointed."""
    qwen = Tokenizer.from_folder(qwen_tokenizer)
    good = '{"items": [{"sku": "a1", "qty": 2}], "note": "soon", "then": {"items": [{"sku": "b2", "qty": 1}], "note": "", "then": null}}'
    bad = [
        good.replace('"a1"', '"c3"'),  # not in the Item's enum
        good.replace('"qty": 2', '"qty": 0'),  # below the Item's minimum
        good.replace('"soon"', '"tomorrow!"'),  # longer than the Note's maxLength
        good.replace('"then": null', '"then": {"items": []}'),  # the root's schema, nested: too few items
    ]
    as_hermes = '<tool_call>\n{"name": "place_order", "arguments": %s}\n</tool_call>'
    as_llama = '{"name": "place_order", "parameters": %s}'
    as_generic = '{"tool_calls": [{"name": "place_order", "arguments": %s}]}'
    for choice in ("required", {"type": "function", "function": {"name": "place_order"}}):
        tools = ToolChoice.from_request([ORDER, WEATHER], choice, None)
        hermes = tool_calls.grammar(tools, ToolFormat.HERMES, qwen)
        llama = tool_calls.grammar(tools, ToolFormat.LLAMA3, qwen)
        generic = tool_calls.grammar(tools, ToolFormat.GENERIC, qwen)
        for grammar, form in ((hermes, as_hermes), (llama, as_llama), (generic, as_generic)):
            assert _accepts(qwen, grammar, form % good)
            for arguments in bad:
                assert not _accepts(qwen, grammar, form % arguments), arguments
    # parameters made by inheritance keep their parts open through the grammar's own rewriting, too
    inherited = {
        "type": "function",
        "function": {
            "name": "place_order",
            "parameters": {
                "$defs": {"Base": {"type": "object", "properties": {"sku": {"enum": ["a1"]}}, "required": ["sku"]}},
                "allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"qty": {"type": "integer"}}, "required": ["qty"]}],
            },
        },
    }
    calls = ToolChoice.from_request([inherited, WEATHER], "required", None)
    for fmt, form in ((ToolFormat.HERMES, as_hermes), (ToolFormat.LLAMA3, as_llama), (ToolFormat.GENERIC, as_generic)):
        assert _accepts(qwen, tool_calls.grammar(calls, fmt, qwen), form % '{"sku": "a1", "qty": 2}'), fmt
        # WEATHER's parameters do not mention other keys: none may come, in every format
        weather = (form % '{"city": "Rome", "days": 2}').replace("place_order", "get_weather")
        assert _accepts(qwen, tool_calls.grammar(calls, fmt, qwen), weather), fmt
        assert not _accepts(qwen, tool_calls.grammar(calls, fmt, qwen), weather.replace("2}", '2, "x": 1}')), fmt
    anything = {"type": "function", "function": {"name": "place_order", "parameters": {}}}
    loose = tool_calls.grammar(ToolChoice.from_request([anything], "required", None), ToolFormat.LLAMA3, qwen)
    assert _accepts(qwen, loose, as_llama % '{"any": ["keys"]}')
    assert not _accepts(qwen, loose, as_llama % "[1, 2]")  # `{}` allows any object, not any value
    smol = Tokenizer.from_gguf(bundled_gguf)
    auto = tool_calls.grammar(ToolChoice.from_request([WEATHER, ORDER], "auto", None), ToolFormat.GENERIC, smol)
    assert _accepts(smol, auto, as_generic % good)
    assert not _accepts(smol, auto, as_generic % bad[0])
    assert _accepts(smol, auto, '{"content": "Done."}')


ANSWERS = [
    (
        ToolFormat.HERMES,
        'Checking.\n<tool_call>\n{"name": "a", "arguments": {"x": [1, {"y": "}"}], "z": {}}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
        "Checking.",
        [("a", '{"x": [1, {"y": "}"}], "z": {}}'), ("b", "{}")],
    ),
    (ToolFormat.HERMES, "No calls, just <tool talk.", "No calls, just <tool talk.", []),
    (
        ToolFormat.HERMES,
        '<tool_call>\n{"arguments": {"q": "\\"x\\""}, "name": "late"}\n</tool_call>',
        None,
        [("late", '{"q": "\\"x\\""}')],
    ),
    (ToolFormat.LLAMA3, '<|python_tag|>{"name": "f", "parameters": {"x": 1}}', None, [("f", '{"x": 1}')]),
    (ToolFormat.LLAMA3, '{"name": "f", "parameters": "{\\"x\\": 1}"}', None, [("f", '{"x": 1}')]),
    (ToolFormat.LLAMA3, "Hello there.", "Hello there.", []),
    (ToolFormat.LLAMA3, '{"x": 1}', '{"x": 1}', []),
    (
        ToolFormat.GENERIC,
        '{"tool_calls": [{"name": "f", "arguments": {"s": "é"}}, {"name": "g", "arguments": {}}]}',
        None,
        [("f", '{"s": "é"}'), ("g", "{}")],
    ),
    (ToolFormat.GENERIC, '{"content": "caf\\u00e9 \\ud83d\\ude00 \\"q\\" \\\\ done"}', 'café 😀 "q" \\ done', []),
    # cut short at max_tokens: kvserve's wrapper is never content; a call whose name is whole is a call
    (ToolFormat.GENERIC, '{"tool_calls": [{"name": "get_', None, []),
    (ToolFormat.GENERIC, '{"tool_calls": [{"name": "f", "arguments": {"x": 1', None, [("f", '{"x": 1')]),
    (ToolFormat.GENERIC, '{"content": "Hel', "Hel", []),
    (ToolFormat.LLAMA3, '<|python_tag|>{"na', None, []),
    (ToolFormat.LLAMA3, '{"name": "f", "param', None, [("f", "")]),
    (ToolFormat.LLAMA3, '{"parameters": {"x', None, []),
    # JSON that is not a call stays the model's answer, whole, malformed or cut short
    (ToolFormat.LLAMA3, '{"Paris" is the capital of France}', '{"Paris" is the capital of France}', []),
    (ToolFormat.LLAMA3, '{"city": "Paris", "population": 21', '{"city": "Paris", "population": 21', []),
]


@pytest.mark.parametrize("fmt, text, content, calls", ANSWERS)
def test_answers_parse_the_same_whole_and_in_any_pieces(fmt, text, content, calls):
    whole = parse(text, fmt)
    assert whole.content == content
    assert [(c.name, c.arguments) for c in whole.tool_calls] == calls
    for seed in range(30):
        rng = random.Random(seed)
        parser = tool_calls.ToolCallParser(fmt)
        deltas, i = [], 0
        while i < len(text):
            size = rng.randint(1, 6)
            deltas += parser.feed(text[i : i + size])
            i += size
        deltas += parser.finish()
        pieces = tool_calls.assemble(deltas)
        assert (pieces.content, [(c.name, c.arguments) for c in pieces.tool_calls]) == (content, calls)
        starts = [d for d in deltas if d.id is not None]
        assert [d.name for d in starts] == [name for name, _ in calls]  # id and name before any argument
        for d in deltas:
            if d.index is not None and d.id is None:
                assert any(s.index == d.index for s in starts[: d.index + 1])


@pytest.mark.parametrize(
    "tools, choice, match",
    [
        ([{"type": "function", "function": {"name": "bad name!"}}], None, r"tools\[0\].function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}], None, "parameters"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            None,
            "describe an object",
        ),
        ([{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}], None, "does not support"),
        ([{"type": "retrieval"}], None, r"tools\[0\]"),
        ([WEATHER, WEATHER], None, "twice"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not in tools"),
        ([WEATHER], "sometimes", "tool_choice must be"),
        (None, "required", "needs tools"),
        ([WEATHER] * 129, None, "at most 128"),
        # a misspelt key was ignored (the function called without its parameters); OpenAI refuses it
        ([{"type": "function", "function": {"name": "f", "paramters": {}}}], None, "'paramters', which is not"),
        ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], None, "strict must be true or false"),
        ([WEATHER], {"type": "function", "function": {"name": "get_weather"}, "x": 1}, "tool_choice has the key 'x'"),
        ([{"type": "function", "function": {"name": "get_weather\n"}}], None, "letters, digits"),  # $ took the \n
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#", "description": "me"}}}],
            None,
            "loop of references",
        ),
    ],
    ids=[
        "name",
        "bad-schema",
        "not-object",
        "unsupported",
        "not-function",
        "duplicate",
        "unknown-choice",
        "bad-choice",
        "no-tools",
        "too-many",
        "misspelt-key",
        "strict-not-bool",
        "choice-extra-key",
        "name-newline",
        "reference-loop",
    ],
)
def test_bad_tools_are_refused_by_name(tools, choice, match):
    with pytest.raises(InvalidRequestError, match=match):
        ToolChoice.from_request(tools, choice, None)


def test_a_history_is_checked_as_openai_checks_it(bundled_gguf):
    tokenizer = Tokenizer.from_gguf(bundled_gguf)

    def call(arguments):
        return {
            "role": "assistant",
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}],
        }

    user = {"role": "user", "content": "hi"}
    result = {"role": "tool", "tool_call_id": "c", "content": "done"}
    for no_arguments in ("", "{}", {}):  # "" as some clients send a call without arguments
        rendered = tool_calls.conversation([user, call(no_arguments), result], ToolFormat.GENERIC, tokenizer)
        assert json.loads(rendered[1]["content"])["tool_calls"][0]["arguments"] == {}
    for arguments in ("[1, 2]", "[]", "null", "{oops", None):
        with pytest.raises(InvalidRequestError, match="JSON object") as err:
            tool_calls.conversation([user, call(arguments)], ToolFormat.GENERIC, tokenizer)
        assert err.value.param == "messages[1].tool_calls[0].function.arguments"
    # deeper than Python's stack (a RecursionError, a 500), or than the template's rendering takes
    for deep in ('{"a": ' + "[" * 3000 + "]" * 3000 + "}", '{"a": ' + "[" * 200 + "]" * 200 + "}"):
        with pytest.raises(InvalidRequestError, match="levels deep") as err:
            tool_calls.conversation([user, call(deep)], ToolFormat.GENERIC, tokenizer)
        assert err.value.param == "messages[1].tool_calls[0].function.arguments"
    for history in ([user, result], [user, call("{}"), {**result, "tool_call_id": "other"}]):
        with pytest.raises(InvalidRequestError, match="no earlier assistant message") as err:
            tool_calls.conversation(history, ToolFormat.GENERIC, tokenizer)
        assert err.value.param.endswith(".tool_call_id")
