"""Every client API through the real stack, with the official clients (openai: chat completions,
completions, Responses; anthropic: Messages; ollama: chat, generate, tags, ps, show), streamed and
not, on a model whose chat template (Qwen3-like) opens a <think> block for the answer and renders
tools, tool calls and tool results Hermes-style: a random model never closes the block, so its whole
output must arrive as reasoning (reasoning_content, thinking blocks, reasoning items, `thinking`);
tool definitions and results reach the prompt through the template (the usage counts exactly the
template's rendering); errors come in each client's shape; a quantized name is served by the same
base model; forced tool calls (tool_choice) come back parsed. One file past ~450 lines because every
test shares one stack (~30 s to start), which a split would start twice."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import anthropic
import ollama
import openai
import pytest

from fleet_local import stack
from tests.support import embedded_stack, make_chat_model, mlx_greedy, prompt_ids, until_state

MODEL = "tiny/thinker"
GREEDY = {"temperature": 0}  # the anthropic SDK no longer takes sampling arguments; the API still does
MESSAGES = [{"role": "user", "content": "What is two plus two?"}]  # greedy: mostly printable bytes
THINKING_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these tools:\n"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{% for call in message.tool_calls %}\n<tool_call>\n"
    '{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}"
    "\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[stack.StackManifest, Path]]:
    model_dir = make_chat_model(tmp_path_factory.mktemp("thinker"))
    (model_dir / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    plain_dir = make_chat_model(tmp_path_factory.mktemp("plain"))
    with embedded_stack(tmp_path_factory.mktemp("fleet-think"), MODEL, model_dir) as manifest:
        asyncio.run(serve_plain(manifest.gateway_url, plain_dir))
        yield manifest, model_dir


PLAIN = "tiny/plain"


async def serve_plain(gateway: str, folder: Path) -> None:
    """A second model, whose ChatML template knows no tools."""
    async with aiohttp.ClientSession() as session:
        body = {"model": PLAIN, "source": f"file://{folder}"}
        async with session.post(f"{gateway}/models", json=body) as response:
            assert response.status < 300, await response.text()
        await until_state(session, gateway, lambda s: PLAIN in s["models"], 60)
        async with session.post(f"{gateway}/instances", json={"model": PLAIN}) as response:
            assert response.status < 300, await response.text()
        await until_state(
            session,
            gateway,
            lambda s: any(i["model_id"] == PLAIN and i["status"] == "ready" for i in s["instances"].values()),
            120,
        )


def expected_reasoning(model_dir: Path, max_tokens: int) -> tuple[str, int]:
    from fleet_gateway.detokenize import IncrementalDetokenizer
    from fleet_gateway.tokenizer import ChatTokenizer

    tokenizer = ChatTokenizer.from_folder(model_dir)
    prompt = prompt_ids(model_dir, MESSAGES)
    assert tokenizer.decode(prompt).endswith("<think>\n")
    detokenizer = IncrementalDetokenizer(tokenizer)  # the gateway's own text of those tokens
    text = detokenizer.push(mlx_greedy(model_dir, prompt, max_tokens)) + detokenizer.flush()
    assert text.strip() and "</think>" not in text  # a random model never closes it: all reasoning
    return text, len(prompt)


def test_reasoning_is_split_from_the_answer(thinker) -> None:
    manifest, model_dir = thinker
    client = openai.OpenAI(base_url=f"{manifest.gateway_url}/v1", api_key="unused", max_retries=0)
    reasoning, prompt_tokens = expected_reasoning(model_dir, 10)
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0)
    message = reply.choices[0].message
    assert message.reasoning_content == reasoning and message.content == ""
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt_tokens, 10)

    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, stream=True
    )
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == ""


def test_tools_and_tool_results_render_through_the_chat_template(thinker) -> None:
    from fleet_gateway.tokenizer import ChatTokenizer

    manifest, model_dir = thinker
    client = openai.OpenAI(base_url=f"{manifest.gateway_url}/v1", api_key="unused", max_retries=0)
    tokenizer = ChatTokenizer.from_folder(model_dir)
    # what the gateway must render: the call's arguments as an object, as HF templates expect
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
    }
    turns = [TOOL_TURNS[0], {**TOOL_TURNS[1], "content": "", "tool_calls": [call]}, TOOL_TURNS[2]]
    rendered = tokenizer.render_chat(turns, tools=TOOLS)
    assert '"name": "get_weather"' in rendered and "<tool_response>\nsunny, 21 C" in rendered
    reply = client.chat.completions.create(
        model=MODEL, messages=TOOL_TURNS, tools=TOOLS, max_tokens=4, temperature=0
    )
    assert reply.usage.prompt_tokens == len(tokenizer.encode(rendered))
    assert reply.choices[0].finish_reason in ("length", "stop")  # a random model calls nothing
    # tool_choice "none": the tools are not rendered
    bare = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=2, temperature=0
    )
    assert bare.usage.prompt_tokens == len(prompt_ids(model_dir, MESSAGES))


def test_a_model_whose_template_has_no_tools_refuses_them(thinker) -> None:
    manifest, _ = thinker
    client = openai.OpenAI(base_url=f"{manifest.gateway_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=PLAIN, messages=MESSAGES, tools=TOOLS, max_tokens=2)
    assert refused.value.body["param"] == "tools" and "does not render tools" in refused.value.body["message"]


def test_text_completions_take_a_raw_prompt_streamed_and_not(thinker) -> None:
    from fleet_gateway.detokenize import IncrementalDetokenizer
    from fleet_gateway.tokenizer import ChatTokenizer

    manifest, _ = thinker
    plain_dir = Path(manifest.state_dir) / "models" / PLAIN / "main"
    client = openai.OpenAI(base_url=f"{manifest.gateway_url}/v1", api_key="unused", max_retries=0)
    tokenizer = ChatTokenizer.from_folder(plain_dir)
    text = "the sea and the sky are"
    ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer)
    expected = detokenizer.push(mlx_greedy(plain_dir, ids, 6)) + detokenizer.flush()

    reply = client.completions.create(model=PLAIN, prompt=text, max_tokens=6, temperature=0)
    assert reply.object == "text_completion" and reply.choices[0].text == expected
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), 6)
    assert reply.choices[0].finish_reason == "length"
    by_ids = client.completions.create(model=PLAIN, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == expected
    stream = client.completions.create(
        model=PLAIN,
        prompt=text,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 6
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=PLAIN, prompt=text, echo=True)
    assert refused.value.body["param"] == "echo"


def rendered_tokens(model_dir: Path, messages, tools=None) -> int:
    from fleet_gateway.tokenizer import ChatTokenizer

    tokenizer = ChatTokenizer.from_folder(model_dir)
    return len(tokenizer.encode(tokenizer.render_chat(messages, tools=tools)))


# the same conversation as TOOL_TURNS, as each API writes it (the template sees the same messages)
TEMPLATE_TOOL_TURNS = [
    TOOL_TURNS[0],
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    TOOL_TURNS[2],
]


def test_anthropic_messages_split_thinking_count_usage_and_stream_events(thinker) -> None:
    manifest, model_dir = thinker
    client = anthropic.Anthropic(base_url=manifest.gateway_url, api_key="unused", max_retries=0)
    reasoning, prompt_tokens = expected_reasoning(model_dir, 10)
    reply = client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=10, extra_body=GREEDY)
    assert [block.type for block in reply.content] == ["thinking"]
    assert reply.content[0].thinking == reasoning
    assert reply.stop_reason == "max_tokens" and reply.role == "assistant"
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (prompt_tokens, 10)

    with client.messages.stream(model=MODEL, messages=MESSAGES, max_tokens=10, extra_body=GREEDY) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "message_delta" in events
    assert final.content[0].thinking == reasoning and final.usage.output_tokens == 10

    # a stop sequence taken from the known output ends it there, and says which one
    stop = reasoning[4:6]
    cut = client.messages.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, extra_body=GREEDY, stop_sequences=[stop]
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].thinking == reasoning[: reasoning.index(stop)]


def test_anthropic_tools_and_tool_results_render_through_the_template(thinker) -> None:
    manifest, model_dir = thinker
    client = anthropic.Anthropic(base_url=manifest.gateway_url, api_key="unused", max_retries=0)
    function = TOOLS[0]["function"]
    tools = [
        {
            "name": function["name"],
            "description": function["description"],
            "input_schema": function["parameters"],
        }
    ]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "sunny, 21 C"}],
        },
    ]
    expected = rendered_tokens(model_dir, TEMPLATE_TOOL_TURNS, TOOLS)
    reply = client.messages.create(
        model=MODEL, messages=messages, tools=tools, max_tokens=3, extra_body=GREEDY
    )
    assert reply.usage.input_tokens == expected
    counted = client.messages.count_tokens(model=MODEL, messages=messages, tools=tools)
    assert counted.input_tokens == expected


def test_anthropic_errors_come_in_anthropic_shape(thinker) -> None:
    manifest, _ = thinker
    client = anthropic.Anthropic(base_url=manifest.gateway_url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="nobody/nothing", messages=MESSAGES, max_tokens=4)
    assert missing.value.body["type"] == "error" and missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, messages=[{"role": "robot", "content": "hi"}], max_tokens=4)
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert "messages.0.role" in bad.value.body["error"]["message"]


def test_ollama_chat_splits_thinking_streamed_and_not_at_both_prefixes(thinker) -> None:
    manifest, model_dir = thinker
    reasoning, prompt_tokens = expected_reasoning(model_dir, 10)
    options = {"num_predict": 10, "temperature": 0}
    for host in (manifest.gateway_url, f"{manifest.gateway_url}/ollama"):
        client = ollama.Client(host=host)
        reply = client.chat(model=MODEL, messages=MESSAGES, options=options, stream=False)
        assert reply.message.thinking == reasoning and reply.message.content == ""
        assert (reply.prompt_eval_count, reply.eval_count, reply.done_reason) == (prompt_tokens, 10, "length")
        parts = list(client.chat(model=MODEL, messages=MESSAGES, options=options, stream=True))
        assert "".join(p.message.thinking or "" for p in parts) == reasoning
        assert parts[-1].done and not any(p.done for p in parts[:-1])
        assert parts[-1].eval_count == 10 and parts[-1].total_duration > 0


def test_ollama_tools_generate_and_model_listings(thinker) -> None:
    manifest, model_dir = thinker
    client = ollama.Client(host=manifest.gateway_url)
    messages = [
        TOOL_TURNS[0],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "sunny, 21 C", "tool_name": "get_weather"},
    ]
    reply = client.chat(model=MODEL, messages=messages, tools=TOOLS, options={"num_predict": 2}, stream=False)
    assert reply.prompt_eval_count == rendered_tokens(model_dir, TEMPLATE_TOOL_TURNS, TOOLS)

    from fleet_gateway.detokenize import IncrementalDetokenizer
    from fleet_gateway.tokenizer import ChatTokenizer

    plain_dir = Path(manifest.state_dir) / "models" / PLAIN / "main"
    tokenizer = ChatTokenizer.from_folder(plain_dir)
    text = "the sea and the sky are"
    detokenizer = IncrementalDetokenizer(tokenizer)
    expected = detokenizer.push(mlx_greedy(plain_dir, tokenizer.encode(text), 6)) + detokenizer.flush()
    raw = client.generate(model=PLAIN, prompt=text, raw=True, options={"num_predict": 6, "temperature": 0})
    assert raw.response == expected and raw.eval_count == 6
    templated = client.generate(model=PLAIN, prompt="hello", options={"num_predict": 3, "temperature": 0})
    assert templated.prompt_eval_count == len(prompt_ids(plain_dir, [{"role": "user", "content": "hello"}]))
    assert client.generate(model=PLAIN, prompt="").done_reason == "load"
    with pytest.raises(ollama.ResponseError) as empty:  # raw ignores the system prompt: no tokens
        client.generate(model=PLAIN, prompt="", system="be brief", raw=True)
    assert empty.value.status_code == 400 and "empty" in empty.value.error

    assert {m.model for m in client.list().models} >= {MODEL, PLAIN}
    assert {m.model for m in client.ps().models} >= {MODEL, PLAIN}
    shown = client.show(MODEL)
    assert "<think>" in shown.template and {"completion", "tools", "thinking"} <= set(shown.capabilities)
    with pytest.raises(ollama.ResponseError) as missing:
        client.chat(model="nobody/nothing", messages=MESSAGES, stream=False)
    assert missing.value.status_code == 404 and "nobody/nothing" in missing.value.error


def test_responses_api_reasoning_items_usage_and_events(thinker) -> None:
    manifest, model_dir = thinker
    client = openai.OpenAI(base_url=f"{manifest.gateway_url}/v1", api_key="unused", max_retries=0)
    reasoning, prompt_tokens = expected_reasoning(model_dir, 10)
    question = MESSAGES[0]["content"]
    reply = client.responses.create(model=MODEL, input=question, max_output_tokens=10, temperature=0)
    assert [item.type for item in reply.output] == ["reasoning"]
    assert reply.output[0].content[0].text == reasoning and reply.output_text == ""
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (prompt_tokens, 10)

    with client.responses.stream(model=MODEL, input=question, max_output_tokens=10, temperature=0) as stream:
        events = list(stream)
    numbers = [event.sequence_number for event in events]
    assert numbers == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == reasoning and events[-1].response.output[0].content[0].text == reasoning


def test_responses_api_renders_function_calls_and_outputs(thinker) -> None:
    manifest, model_dir = thinker
    client = openai.OpenAI(base_url=f"{manifest.gateway_url}/v1", api_key="unused", max_retries=0)
    function = TOOLS[0]["function"]
    tools = [{"type": "function", **function}]
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
    ]
    reply = client.responses.create(model=MODEL, input=items, tools=tools, max_output_tokens=3, temperature=0)
    assert reply.usage.input_tokens == rendered_tokens(model_dir, TEMPLATE_TOOL_TURNS, TOOLS)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_1")
    assert refused.value.body["param"] == "previous_response_id"


def test_a_quantized_name_is_served_by_the_same_base_model(thinker) -> None:
    manifest, _ = thinker
    client = openai.OpenAI(base_url=f"{manifest.gateway_url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="someone/thinker-4bit", messages=MESSAGES, max_tokens=2, temperature=0
    )
    assert reply.model == MODEL and reply.usage.completion_tokens == 2


def written(raw: bytes) -> str:
    """A token's text as OpenAI writes it: a piece of a UTF-8 character as its bytes."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join("\\x" + format(b, "02x") for b in raw)


def test_logprobs_of_chat_and_text_completions(thinker) -> None:
    manifest, _ = thinker
    client = openai.OpenAI(base_url=f"{manifest.gateway_url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    scores = reply.choices[0].logprobs.content
    assert len(scores) == reply.usage.completion_tokens == 5
    for score in scores:  # greedy: each sampled token is the likeliest of its top two
        assert len(score.top_logprobs) == 2 and score.top_logprobs[0].logprob == score.logprob <= 0
        assert score.token == written(bytes(score.bytes))
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, stream=True
    )
    streamed = [
        s
        for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs
        for s in chunk.choices[0].logprobs.content
    ]
    assert [(s.token, s.logprob) for s in streamed] == [(s.token, s.logprob) for s in scores]
    assert all(s.top_logprobs == [] for s in streamed)

    text = client.completions.create(model=PLAIN, prompt="the sea", max_tokens=4, temperature=0, logprobs=2)
    legacy = text.choices[0].logprobs
    assert len(legacy.tokens) == len(legacy.token_logprobs) == len(legacy.text_offset) == 4
    assert legacy.text_offset == [sum(len(t) for t in legacy.tokens[:i]) for i in range(4)]
    assert all(
        1 <= len(top) <= 2 and max(top.values()) == lp
        for top, lp in zip(legacy.top_logprobs, legacy.token_logprobs, strict=True)
    )
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


# Bounded arguments (an enum, a small integer, a boolean) so that only the constraint decides whether
# a call comes: a random model may spell a call one byte a token (~100 tokens for forecast, ~85 for
# alarm, with the whitespace it may add), and max_tokens leaves room for that beside the rendered
# tools in the model's 512 positions.
FORECAST = {
    "type": "object",
    "properties": {
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["unit", "days"],
}
ALARM = {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}
FORCED_TOOLS = [
    {"type": "function", "function": {"name": "forecast", "parameters": FORECAST}},
    {"type": "function", "function": {"name": "alarm", "parameters": ALARM}},
]


def valid_call(name: str, arguments: dict) -> bool:
    if name == "alarm":
        return set(arguments) == {"on"} and isinstance(arguments["on"], bool)
    days = arguments.get("days")
    return name == "forecast" and arguments.get("unit") in ("c", "f") and 1 <= days <= 5


def test_tool_choice_required_always_yields_a_call_within_the_schema(thinker) -> None:
    manifest, _ = thinker
    client = openai.OpenAI(base_url=f"{manifest.gateway_url}/v1", api_key="unused", max_retries=0)
    for seed in range(5):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            tools=FORCED_TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=120,
            temperature=1,
            seed=seed,
        )
        [choice] = reply.choices
        assert choice.finish_reason == "tool_calls", (seed, choice)
        [call] = choice.message.tool_calls
        assert valid_call(call.function.name, json.loads(call.function.arguments)), (seed, call)


def test_tool_choice_naming_a_function_calls_only_it(thinker) -> None:
    manifest, _ = thinker
    client = openai.OpenAI(base_url=f"{manifest.gateway_url}/v1", api_key="unused", max_retries=0)
    choice = {"type": "function", "function": {"name": "alarm"}}
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=FORCED_TOOLS,
        tool_choice=choice,
        max_tokens=100,
        temperature=1,
        seed=11,
        stream=True,
    )
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    calls = [call.function for delta in deltas for call in delta.tool_calls or []]
    # parallel calls allowed: one or more, each of alarm (a last one max_tokens cut stays text)
    assert calls and all(valid_call(c.name, json.loads(c.arguments)) and c.name == "alarm" for c in calls)


def test_anthropic_tool_choice_any_yields_a_tool_use_block(thinker) -> None:
    manifest, _ = thinker
    client = anthropic.Anthropic(base_url=manifest.gateway_url, api_key="unused", max_retries=0)
    tools = [{"name": "alarm", "input_schema": ALARM}]  # both tools would leave too little room
    reply = client.messages.create(
        model=MODEL,
        messages=MESSAGES,
        tools=tools,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        max_tokens=120,
        extra_body={"temperature": 1},
    )
    [block] = [block for block in reply.content if block.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and valid_call(block.name, block.input)
