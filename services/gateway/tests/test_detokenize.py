"""IncrementalDetokenizer: streamed deltas concatenate to the one-shot decode, never split a character."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleet_gateway.detokenize import IncrementalDetokenizer
from fleet_gateway.tokenizer import ChatTokenizer

from .tiny_tokenizer import IM_END_ID, IM_START_ID, VOCAB_SIZE, make_tiny_tokenizer_folder

pytestmark = pytest.mark.unit

PROPERTY = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    folder: Path = make_tiny_tokenizer_folder(tmp_path_factory.mktemp("tiny"))
    return ChatTokenizer.from_folder(folder)


def _stream(detok: IncrementalDetokenizer, ids: list[int], sizes: list[int]) -> list[str]:
    """Push `ids` in chunks of the given sizes (cycled), then flush; the pieces returned."""
    pieces, start, step = [], 0, 0
    while start < len(ids):
        size = sizes[step % len(sizes)]
        pieces.append(detok.push(ids[start : start + size]))
        start, step = start + size, step + 1
    pieces.append(detok.flush())
    return pieces


@PROPERTY
@given(
    ids=st.lists(st.integers(min_value=0, max_value=VOCAB_SIZE - 1), max_size=60),
    sizes=st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=8),
)
def test_random_ids_concatenate_to_the_full_decode(
    tok: ChatTokenizer, ids: list[int], sizes: list[int]
) -> None:
    # Random byte tokens make invalid UTF-8 too: the stream must still equal the one-shot decode.
    pieces = _stream(IncrementalDetokenizer(tok), ids, sizes)
    assert "".join(pieces) == tok.decode(ids)
    # Only the final flush may carry an incomplete (replacement) character at its end.
    assert not any(piece.endswith("\ufffd") for piece in pieces[:-1])


@PROPERTY
@given(
    ids=st.lists(st.integers(min_value=0, max_value=VOCAB_SIZE - 1), max_size=40),
    sizes=st.lists(st.integers(min_value=1, max_value=3), min_size=1, max_size=4),
)
def test_random_ids_keeping_special_tokens(tok: ChatTokenizer, ids: list[int], sizes: list[int]) -> None:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(_stream(detok, ids, sizes)) == tok.decode(ids, skip_special_tokens=False)


@PROPERTY
@given(text=st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=40))
def test_text_streamed_token_by_token_never_splits_a_character(tok: ChatTokenizer, text: str) -> None:
    ids = tok.encode(text)
    pieces = _stream(IncrementalDetokenizer(tok), ids, [1])
    assert "".join(pieces) == text
    if "\ufffd" not in text:
        assert not any("\ufffd" in piece for piece in pieces)


def test_multibyte_character_is_held_until_complete(tok: ChatTokenizer) -> None:
    ids = tok.encode("a𝄞")  # 𝄞 is not in the corpus: one token per UTF-8 byte
    assert len(ids) == 5
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([i]) for i in ids] == ["a", "", "", "", "𝄞"]
    assert detok.flush() == ""
    assert detok.token_ids == ids


def test_flush_emits_an_incomplete_character_like_decode(tok: ChatTokenizer) -> None:
    ids = tok.encode("x𝄞")[:3]  # "x" and two of 𝄞's four bytes
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids[:1]) == "x"
    assert detok.push(ids[1:]) == ""
    tail = detok.flush()
    assert tail == "\ufffd"
    assert "x" + tail == tok.decode(ids)
    assert detok.flush() == ""


def test_special_tokens_produce_no_text(tok: ChatTokenizer) -> None:
    detok = IncrementalDetokenizer(tok)
    hello = tok.encode("Hello")
    assert detok.push([IM_START_ID]) == ""
    assert detok.push(hello) == "Hello"
    assert detok.push([IM_END_ID]) == ""
    assert detok.push([]) == ""
    assert detok.flush() == ""


def test_spaces_between_tokens_are_kept(tok: ChatTokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push([i]) for i in tok.encode(text)]
    assert len(pieces) > 3
    assert "".join(pieces) + detok.flush() == text


def test_works_on_a_raw_tokenizers_tokenizer(tok: ChatTokenizer) -> None:
    ids = tok.encode("Paris, 東京 and São Paulo")
    detok = IncrementalDetokenizer(tok.tokenizer)
    assert "".join(detok.push([i]) for i in ids) + detok.flush() == "Paris, 東京 and São Paulo"
