"""Reasoning and tools through the stack, with the official openai client, on a model whose chat
template (Qwen3-like) opens a <think> block for the answer and renders tools, tool calls and tool
results Hermes-style: its output arrives in `reasoning_content` until it closes the block,
streamed and not; tool definitions and results reach the prompt through the template (usage
counts exactly the template's rendering); a model whose template has no tools refuses them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest

from fleet_local import stack
from tests.support import embedded_stack, make_chat_model, mlx_greedy, prompt_ids, until_state

MODEL = "tiny/thinker"
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
