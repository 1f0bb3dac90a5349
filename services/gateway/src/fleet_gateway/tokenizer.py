"""A model's tokenizer and chat template, read from a local Hugging Face folder.

Uses `tokenizers` (tokenizer.json) and a sandboxed jinja2 environment like transformers'
`apply_chat_template`, without importing transformers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, decoders

Message = Mapping[str, Any]


class TemplateError(ValueError):
    """The model has no chat template, or rendering it failed (or the template raised)."""


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson HTML-escapes <, >, & and '; chat templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _token_content(token: Any) -> str | None:
    """tokenizer_config's bos/eos: a string, or the AddedToken form {"content": ...}."""
    if isinstance(token, str):
        return token
    if isinstance(token, Mapping) and isinstance(token.get("content"), str):
        return token["content"]
    return None


def _pick_template(value: Any) -> str | None:
    """A chat_template value: a string, or a list of {"name", "template"} (take "default")."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, Mapping)}
        if "default" in named:
            return named["default"]
        raise TemplateError(f"chat_template lists {sorted(map(str, named))} but no 'default' template")
    raise TemplateError(f"chat_template has an unexpected type: {type(value).__name__}")


def _gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, char -> byte: printable bytes stand for themselves, the others
    for the characters from U+0100 on, in order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_OF_CHAR = _gpt2_byte_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _flatten_content(content: Any) -> Any:
    """OpenAI-style content parts [{"type": "text", "text": ...}] -> one string."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise TemplateError(f"unsupported content part {kind!r}: only text parts are supported")
        texts.append(str(part.get("text", "")))
    return "\n".join(texts)


class ChatTokenizer:
    """Tokenizer + chat template of one model. Immutable after construction; safe to share."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str | None = None,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self._template: jinja2.Template | None = None
        if chat_template is not None:
            environment = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            environment.filters["tojson"] = _tojson
            environment.globals["raise_exception"] = _raise_exception
            environment.globals["strftime_now"] = _strftime_now
            try:
                self._template = environment.from_string(chat_template)
            except jinja2.TemplateError as exc:
                raise TemplateError(f"the chat template does not compile: {exc}") from exc

    @classmethod
    def from_folder(cls, path: str | Path, *, chat_template: str | None = None) -> ChatTokenizer:
        """Load tokenizer.json, tokenizer_config.json and (optional) generation_config.json.

        The template is `chat_template` if given, else chat_template.jinja (transformers >= 4.43
        saves it there), else tokenizer_config.json's `chat_template`, else chat_template.json's.
        """
        folder = Path(path)
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        # some tokenizer.json files pad and truncate every input (sentence-transformers' to 128):
        # one prompt is never padded, and lengths are checked where the request is
        tokenizer.no_padding()
        tokenizer.no_truncation()
        config = _read_json(folder / "tokenizer_config.json")
        if chat_template is None:
            jinja_file = folder / "chat_template.jinja"
            if jinja_file.is_file():
                chat_template = jinja_file.read_text(encoding="utf-8")
            elif config.get("chat_template") is not None:
                chat_template = _pick_template(config["chat_template"])
            else:
                chat_template = _pick_template(_read_json(folder / "chat_template.json").get("chat_template"))
        bos_token = _token_content(config.get("bos_token"))
        eos_token = _token_content(config.get("eos_token"))

        # Stop at every end token the model declares: generation_config's, then the tokenizer's eos.
        eos_ids: list[int] = []
        generation_eos = _read_json(folder / "generation_config.json").get("eos_token_id")
        if isinstance(generation_eos, int):
            eos_ids.append(generation_eos)
        elif isinstance(generation_eos, list):
            eos_ids.extend(token for token in generation_eos if isinstance(token, int))
        if eos_token is not None:
            eos_id = tokenizer.token_to_id(eos_token)
            if eos_id is not None:
                eos_ids.append(eos_id)
        return cls(tokenizer, chat_template, bos_token=bos_token, eos_token=eos_token, eos_token_ids=eos_ids)

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, also when they are not a whole UTF-8 character (decoding
        it alone would give U+FFFD): byte-level BPE pieces map back through GPT-2's byte alphabet,
        SentencePiece byte-fallback pieces are "<0xNN>"."""
        piece = self._tokenizer.id_to_token(token_id) or ""
        byte_piece = _BYTE_FALLBACK.fullmatch(piece)
        if byte_piece:
            return bytes([int(byte_piece.group(1), 16)])
        if isinstance(self._tokenizer.decoder, decoders.ByteLevel) and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        return self._tokenizer.decode([token_id], skip_special_tokens=False).encode()

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added (special) tokens included."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def render_chat(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The prompt text of a conversation, as the model's chat template writes it."""
        if self._template is None:
            raise TemplateError("this model has no chat template; use a completions-style prompt instead")
        plain = [{**message, "content": _flatten_content(message.get("content"))} for message in messages]
        try:
            return self._template.render(
                messages=plain,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                tools=tools,
            )
        except TemplateError:
            raise
        except Exception as exc:  # a template can fail in many ways (undefined, type errors, sandbox)
            raise TemplateError(f"rendering the chat template failed: {exc}") from exc

    def encode_chat(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of a conversation; only the template's own special tokens (no extra BOS)."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        return self.encode(text)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
