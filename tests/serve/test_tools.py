"""Tools: rendered by the chat template's own tools support, calls parsed back (Qwen / Llama 3)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from lorafuse.generation import encode_messages
from lorafuse.serve.responses import assistant_message
from lorafuse.serve.tools import parse_tool_calls, template_message, tool_format
from lorafuse.testing import save_tiny_model

# Qwen2.5's template, the parts that concern tools (system header, calls, tool responses).
QWEN = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}{%- endif %}"
    "\n\n# Tools\n\n<tools>{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "For each function call, return a json object within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant"
    "{%- if message.content %}\n{{ message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}"
    '\n<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}"
    "\n</tool_response><|im_end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
# Llama 3.1's JSON tool calling, shortened the same way.
LLAMA3 = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message.role == 'user' and tools and loop.first %}<|start_header_id|>user<|end_header_id|>\n\n"
    "Given the following functions, respond with a JSON for a function call. Respond in the format "
    '{"name": function name, "parameters": dictionary of argument name and its value}.\n\n'
    "{%- for t in tools %}{{ t | tojson }}\n\n{%- endfor %}{{ message.content }}<|eot_id|>"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{%- set tc = message.tool_calls[0].function %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    '{"name": "{{ tc.name }}", "parameters": {{ tc.arguments | tojson }}}<|eot_id|>'
    "{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n"
    "{{ message.content }}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n{{ message.content }}<|eot_id|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
ROUND_TRIP = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
    {"role": "user", "content": "And so?"},
]


def test_template_formats():
    assert tool_format(QWEN) == "hermes" and tool_format(LLAMA3) == "llama3_json"
    from lorafuse.testing import CHAT_TEMPLATE

    assert tool_format(CHAT_TEMPLATE) is None and tool_format(None) is None


def test_parse_hermes_calls_and_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>{"name": "f", "arguments": {}}</tool_call>')  # fmt: skip
    content, calls = parse_tool_calls(text, "hermes")
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("f", {}),
    ]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    # not a call: stays content, untouched
    for text in (
        "no tools here",
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"x": 1}</tool_call>',
    ):
        assert parse_tool_calls(text, "hermes") == (text, [])
    message = assistant_message(
        "<tool_call>" + json.dumps({"name": "f", "arguments": {"a": 1}}) + "</tool_call>", "hermes"
    )
    assert (
        message["content"] is None
        and message["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'
    )


def test_parse_llama3_json_calls():
    one = '{"name": "get_weather", "parameters": {"city": "Paris; France"}}'
    content, calls = parse_tool_calls(one, "llama3_json")
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {
        "city": "Paris; France"
    }
    two = '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 2}}'
    assert [c["function"]["name"] for c in parse_tool_calls(two, "llama3_json")[1]] == ["a", "b"]
    for text in ("The weather is fine.", '{"city": "Paris"}', ""):
        assert parse_tool_calls(text, "llama3_json") == (text, [])


def test_llama3_round_trip_renders_calls_and_results():
    from lorafuse.testing import chat_tokenizer

    tok = chat_tokenizer()
    tok.chat_template = LLAMA3
    ids = encode_messages(tok, [template_message(m) for m in ROUND_TRIP], [WEATHER])
    text = tok.decode(ids)
    assert (
        '"name": "get_weather"' in text
        and '{"name": "get_weather", "parameters": {"city": "Paris"}}' in text
    )
    assert "ipython" in text and '{"celsius": 21}' in text


@pytest.fixture(scope="module")
def qwen_server(tmp_path_factory, launch_server):
    root = tmp_path_factory.mktemp("tools")
    _, tok = save_tiny_model(root / "qwen")
    tok.chat_template = QWEN
    tok.save_pretrained(root / "qwen")
    with launch_server(["--model", str(root / "qwen"), "--dtype", "fp32"]) as (url, client):
        yield url, client, tok, root


@pytest.mark.slow
def test_tools_rendered_by_the_template_and_round_trip(qwen_server):
    url, client, tok, _ = qwen_server
    r = client.chat.completions.create(model="qwen", messages=ROUND_TRIP, tools=[WEATHER],
                                       max_tokens=6, temperature=0)  # fmt: skip
    want = encode_messages(tok, [template_message(m) for m in ROUND_TRIP], [WEATHER])
    assert r.usage.prompt_tokens == len(want)  # the template's tools header, call and response
    assert '"get_weather"' in tok.decode(want) and "<tool_response>" in tok.decode(want)
    # the tiny random model writes no call: its text is the content, finish as usual
    msg = r.choices[0].message
    assert msg.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    plain = client.chat.completions.create(
        model="qwen", messages=ROUND_TRIP[:1], max_tokens=6, temperature=0
    )
    assert plain.usage.prompt_tokens < client.chat.completions.create(
        model="qwen", messages=ROUND_TRIP[:1], tools=[WEATHER], max_tokens=1).usage.prompt_tokens  # fmt: skip
    # "none": the model is not told of the tools
    none = client.chat.completions.create(model="qwen", messages=ROUND_TRIP[:1], tools=[WEATHER],
                                          tool_choice="none", max_tokens=6, temperature=0)  # fmt: skip
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    # streamed with tools: held back, then the same content
    chunks = list(client.chat.completions.create(model="qwen", messages=ROUND_TRIP, tools=[WEATHER],
                                                 max_tokens=6, temperature=0, stream=True))  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        msg.content or ""
    )
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


@pytest.mark.slow
def test_tool_requests_refused_clearly(qwen_server):
    url, client, _, _ = qwen_server
    with pytest.raises(openai.BadRequestError, match="'required' is not supported"):
        client.chat.completions.create(model="qwen", messages=ROUND_TRIP[:1], tools=[WEATHER],
                                       tool_choice="required")  # fmt: skip
    bad = [
        {**ROUND_TRIP[1], "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{oops"}}]}
    ]
    r = httpx.post(url + "/v1/chat/completions", json={"model": "qwen", "messages": ROUND_TRIP[:1] + bad},
                   headers={"Authorization": f"Bearer {client.api_key}"})  # fmt: skip
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
