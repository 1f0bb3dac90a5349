"""ChatTokenizer: loading a model folder, rendering chat templates (sandboxed), encoding, end tokens."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fleet_gateway.tokenizer import ChatTokenizer, TemplateError

from .tiny_tokenizer import (
    CHATML_TEMPLATE,
    ENDOFTEXT_ID,
    IM_END_ID,
    IM_START_ID,
    VOCAB_SIZE,
    make_tiny_tokenizer_folder,
)

DEFAULT_SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_tokenizer_folder(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tok(folder: Path) -> ChatTokenizer:
    return ChatTokenizer.from_folder(folder)


def _copy_folder(src: Path, dst: Path, *, config: dict | None = None, generation: dict | None = None) -> Path:
    """The tiny folder with tokenizer_config / generation_config changed (None in a dict: key removed)."""
    dst.mkdir()
    (dst / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    base = json.loads((src / "tokenizer_config.json").read_text())
    for key, value in (config or {}).items():
        if value is None:
            base.pop(key, None)
        else:
            base[key] = value
    (dst / "tokenizer_config.json").write_text(json.dumps(base))
    if generation is not None:
        (dst / "generation_config.json").write_text(json.dumps(generation))
    return dst


def test_loads_the_folder(tok: ChatTokenizer) -> None:
    assert tok.vocab_size == VOCAB_SIZE
    assert tok.eos_token_ids == (IM_END_ID,)
    assert tok.bos_token == "<|im_start|>"
    assert tok.eos_token == "<|im_end|>"
    assert tok.has_chat_template


def test_encode_chat_renders_chatml_with_only_the_templates_special_tokens(tok: ChatTokenizer) -> None:
    messages = [{"role": "user", "content": "Hello 🙂 東京!"}]
    ids = tok.encode_chat(messages)
    expected = DEFAULT_SYSTEM + "<|im_start|>user\nHello 🙂 東京!<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids, skip_special_tokens=False) == expected
    assert ids[0] == IM_START_ID  # no BOS added in front of the template's own tokens
    assert ids.count(IM_START_ID) == 3
    assert ids.count(IM_END_ID) == 2
    assert ENDOFTEXT_ID not in ids
    assert ids == tok.encode(expected)
    assert ids[-3:] == tok.encode("<|im_start|>assistant\n")[-3:]


def test_system_message_replaces_the_default_one(tok: ChatTokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "again"},
    ]
    text = tok.render_chat(messages, add_generation_prompt=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n"
    )


def test_text_content_parts_are_joined(tok: ChatTokenizer) -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    as_parts = tok.encode_chat([{"role": "user", "content": parts}])
    as_string = tok.encode_chat([{"role": "user", "content": "first\nsecond"}])
    assert as_parts == as_string


def test_non_text_content_part_is_a_template_error(tok: ChatTokenizer) -> None:
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    with pytest.raises(TemplateError, match="image_url"):
        tok.encode_chat([{"role": "user", "content": [image]}])


def test_encode_adds_no_special_tokens_and_round_trips(tok: ChatTokenizer) -> None:
    text = "The quick brown fox, café 🚀"
    ids = tok.encode(text)
    assert all(i > IM_END_ID for i in ids)
    assert tok.decode(ids) == text


def test_end_tokens_from_a_generation_config_list(folder: Path, tmp_path: Path) -> None:
    copy = _copy_folder(folder, tmp_path / "m", generation={"eos_token_id": [IM_END_ID, ENDOFTEXT_ID]})
    assert ChatTokenizer.from_folder(copy).eos_token_ids == (IM_END_ID, ENDOFTEXT_ID)


def test_end_tokens_union_generation_config_and_tokenizer_eos(folder: Path, tmp_path: Path) -> None:
    copy = _copy_folder(folder, tmp_path / "m", generation={"eos_token_id": ENDOFTEXT_ID})
    assert ChatTokenizer.from_folder(copy).eos_token_ids == (ENDOFTEXT_ID, IM_END_ID)


def test_end_token_from_tokenizer_config_without_generation_config(folder: Path, tmp_path: Path) -> None:
    copy = _copy_folder(folder, tmp_path / "m", config={"eos_token": {"content": "<|endoftext|>"}})
    loaded = ChatTokenizer.from_folder(copy)
    assert not (copy / "generation_config.json").exists()
    assert loaded.eos_token == "<|endoftext|>"
    assert loaded.eos_token_ids == (ENDOFTEXT_ID,)


def test_named_templates_pick_default(folder: Path, tmp_path: Path) -> None:
    templates = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}"},
    ]
    copy = _copy_folder(folder, tmp_path / "m", config={"chat_template": templates})
    loaded = ChatTokenizer.from_folder(copy)
    assert loaded.render_chat([{"role": "user", "content": "x"}]) == "<|im_start|>x<|im_end|>"


def test_named_templates_without_default_fail(folder: Path, tmp_path: Path) -> None:
    copy = _copy_folder(
        folder, tmp_path / "m", config={"chat_template": [{"name": "tool_use", "template": "T"}]}
    )
    with pytest.raises(TemplateError, match="default"):
        ChatTokenizer.from_folder(copy)


def test_chat_template_jinja_file_takes_precedence(folder: Path, tmp_path: Path) -> None:
    copy = _copy_folder(folder, tmp_path / "m")
    (copy / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}]{% endfor %}")
    loaded = ChatTokenizer.from_folder(copy)
    assert loaded.render_chat([{"role": "user", "content": "x"}]) == "[user]"


def test_no_chat_template_is_a_clear_error(folder: Path, tmp_path: Path) -> None:
    copy = _copy_folder(folder, tmp_path / "m", config={"chat_template": None})
    loaded = ChatTokenizer.from_folder(copy)
    assert not loaded.has_chat_template
    assert loaded.encode("hello") == ChatTokenizer.from_folder(folder).encode("hello")
    with pytest.raises(TemplateError, match="no chat template"):
        loaded.encode_chat([{"role": "user", "content": "hello"}])


def test_raise_exception_in_a_template(tok: ChatTokenizer) -> None:
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    )
    custom = ChatTokenizer(tok.tokenizer, template)
    assert custom.render_chat([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(TemplateError, match="first must be user"):
        custom.render_chat([{"role": "assistant", "content": "x"}])


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages[0].content.nope() }}",  # undefined call
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # sandbox: no dunder access
        "{% set x = [] %}{{ x.append(1) }}",  # immutable sandbox: no mutation
        "{{ 1 / 0 }}",
    ],
)
def test_render_failures_are_template_errors(tok: ChatTokenizer, template: str) -> None:
    with pytest.raises(TemplateError, match="rendering the chat template failed"):
        ChatTokenizer(tok.tokenizer, template).render_chat([{"role": "user", "content": "x"}])


def test_bad_template_syntax_fails_at_load(tok: ChatTokenizer) -> None:
    with pytest.raises(TemplateError, match="does not compile"):
        ChatTokenizer(tok.tokenizer, "{% for %}")


def test_tojson_is_plain_json(tok: ChatTokenizer) -> None:
    custom = ChatTokenizer(tok.tokenizer, "{{ messages | tojson }}|{{ tools | tojson }}")
    rendered = custom.render_chat([{"role": "user", "content": "<b>&'é"}])
    assert rendered == '[{"role": "user", "content": "<b>&\'é"}]|null'


def test_trim_and_lstrip_blocks(tok: ChatTokenizer) -> None:
    template = (
        "{% for m in messages %}\n    {% if m.role == 'user' %}\n<{{ m.content }}>\n    {% endif %}\n"
        "{% endfor %}"
    )
    custom = ChatTokenizer(tok.tokenizer, template)
    assert (
        custom.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
        == "<a>\n<b>\n"
    )


def test_generation_prompt_flag_and_template_variables(tok: ChatTokenizer) -> None:
    template = "{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}|{{ tools is none }}"
    custom = ChatTokenizer(tok.tokenizer, template, bos_token="<s>", eos_token="</s>")
    assert custom.render_chat([]) == "<s>|</s>|True|True"
    assert custom.render_chat([], add_generation_prompt=False) == "<s>|</s>|False|True"
    assert (
        ChatTokenizer(tok.tokenizer, CHATML_TEMPLATE)
        .render_chat([{"role": "user", "content": "x"}], add_generation_prompt=False)
        .endswith("x<|im_end|>\n")
    )


def test_gateway_modules_never_import_ml_frameworks() -> None:
    code = (
        "import sys\n"
        "import fleet_gateway.tokenizer, fleet_gateway.detokenize, fleet_gateway.stops\n"
        "import fleet_gateway.openai_api, fleet_gateway.errors\n"
        "bad = sorted(m for m in ('torch', 'transformers', 'mlx') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
