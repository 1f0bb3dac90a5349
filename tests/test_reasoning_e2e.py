"""Reasoning split through the stack, with the official openai client: a model whose chat template
opens a <think> block for the answer (as Qwen3 and DeepSeek-R1 templates do) gets its output in
`reasoning_content` until it closes the block, streamed and not; usage counts every token."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from fleet_local import stack
from tests.support import embedded_stack, make_chat_model, mlx_greedy, prompt_ids, tiny_tokenizer

MODEL = "tiny/thinker"
MESSAGES = [{"role": "user", "content": "What is two plus two?"}]  # greedy: mostly printable bytes
THINKING_TEMPLATE = tiny_tokenizer.CHATML_TEMPLATE.replace(
    "{{ '<|im_start|>assistant\n' }}", "{{ '<|im_start|>assistant\n<think>\n' }}"
)


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[stack.StackManifest, Path]]:
    model_dir = make_chat_model(tmp_path_factory.mktemp("thinker"))
    assert THINKING_TEMPLATE != tiny_tokenizer.CHATML_TEMPLATE
    (model_dir / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    with embedded_stack(tmp_path_factory.mktemp("fleet-think"), MODEL, model_dir) as manifest:
        yield manifest, model_dir


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
