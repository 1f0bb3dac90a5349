"""Structured outputs for Fleet's own samplers (llama.cpp, MLX): xgrammar, compiled off the step loop.

xgrammar was chosen by measurement (`fleet bench grammar-mask`: its JSON-schema mask costs ~3 us a
token on this CPU, llguidance's ~14 us) and vLLM's engine runs it too (its xgrammar backend).

Every spec becomes one EBNF text (ebnf_of), which every engine compiles, vLLM's included.
A model's `Grammars` prepares its tokenizer once and compiles each spec once, on a thread of its
own: the engine admits a request when its grammar is ready and keeps stepping the others meanwhile.
xgrammar (and the torch it imports, ~4 s) loads with the first structured request, never before.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from fleet_proto import StructuredOutput

KEPT_GRAMMARS = 256  # compiled specs a model keeps (least recently asked for go first)
GRAMMAR_WAIT_S = 0.02  # how long an engine with nothing else to do waits for a grammar per step


class GrammarError(ValueError):
    """The spec does not compile: the client's request is wrong (a 400, not a server failure)."""


def _library_message(error: Exception) -> str:
    """xgrammar's message without its "[hh:mm:ss] /project/cpp/file.cc:123: " prefix."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(error)).strip()


def _escape_ebnf(text: str) -> str:
    escapes = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}
    return "".join(escapes.get(c, f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c) for c in text)


def choice_grammar(choices: Iterable[str]) -> str:
    """EBNF for "exactly one of these strings" (vLLM turns `choice` into a grammar the same way)."""
    return "root ::= " + " | ".join(f'"{_escape_ebnf(choice)}"' for choice in choices)


def spec_kind(spec: StructuredOutput) -> str:
    """The one constraint a spec sets ("" when none or several: a malformed spec)."""
    kinds = [
        name
        for name, set_ in (
            ("json_schema", bool(spec.json_schema)),
            ("json_object", spec.json_object),
            ("regex", bool(spec.regex)),
            ("choice", bool(spec.choice)),
            ("grammar", bool(spec.grammar)),
            ("structural_tag", bool(spec.structural_tag)),
        )
        if set_
    ]
    return kinds[0] if len(kinds) == 1 else ""


# xgrammar 0.2.8 writes a string with minLength/maxLength as characters of this class, which lets
# raw control characters through (JSON forbids U+0000-U+001F in strings: json.loads refused 25 of 30
# such samples of a tiny model); its own unbounded strings use the class below.
_LENIENT_STRING_CHARACTER = r"[^\"\\\r\n]"
_JSON_STRING_CHARACTER = r"[^\0-\x1f\"\\\r\n]"


def json_strings_without_controls(ebnf: str) -> str:
    return ebnf.replace(_LENIENT_STRING_CHARACTER, _JSON_STRING_CHARACTER)


@lru_cache(maxsize=KEPT_GRAMMARS)
def ebnf_of(spec: StructuredOutput) -> str:
    """The spec as xgrammar EBNF, what every engine compiles (vLLM gets it as its `grammar`), so one
    spec is one language everywhere. JSON is written with json.dumps' separators and no free
    whitespace: with xgrammar's any-whitespace JSON, SmolLM2-135M at temperature 1 ran on in
    whitespace to max_tokens in 1 of 24 samples. Raises GrammarError when it does not convert."""
    import xgrammar as xgr

    kind = spec_kind(spec)
    try:
        if kind in ("json_schema", "json_object"):
            schema = spec.json_schema if kind == "json_schema" else '{"type": "object"}'
            return json_strings_without_controls(
                str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
            )
        if kind == "regex":
            return str(xgr.Grammar.from_regex(spec.regex))
        if kind == "choice":
            return choice_grammar(spec.choice)
        if kind == "grammar":
            return str(xgr.Grammar.from_ebnf(spec.grammar))
    except (RuntimeError, ValueError, TypeError) as error:  # xgrammar raises RuntimeError
        raise GrammarError(f"{kind} does not compile: {_library_message(error)}") from None
    raise GrammarError("a structured output sets exactly one constraint (structural tags have no EBNF)")


def compile_spec(compiler: Any, spec: StructuredOutput) -> Any:
    """An xgrammar CompiledGrammar for the spec: its EBNF, or its structural tag."""
    kind = spec_kind(spec)
    source = spec.structural_tag if kind == "structural_tag" else ebnf_of(spec)
    try:
        if kind == "structural_tag":
            return compiler.compile_structural_tag(json.loads(source))
        return compiler.compile_grammar(source)
    except (RuntimeError, ValueError, TypeError) as error:  # a bad tag's JSON is a ValueError too
        raise GrammarError(f"{kind} does not compile: {_library_message(error)}") from None


class TokenConstraint:
    """One request's grammar state: which tokens may come next, given the tokens it accepted."""

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self._vocab_size = vocab_size
        self._bitmask = np.zeros(xgr.get_bitmask_shape(1, vocab_size), dtype=np.int32)

    def allowed(self) -> np.ndarray:
        """A bool per token id: True where the grammar lets it come next. Past its stop token all
        are (an engine that computes a step ahead asks once more; that sample is never used)."""
        if self.terminated:
            return np.ones(self._vocab_size, dtype=bool)
        self._matcher.fill_next_token_bitmask(self._bitmask)
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little", count=self._vocab_size)
        return bits.view(bool)

    def accept(self, token: int) -> bool:
        """Advance past a token (False: the grammar refuses it, or it ended; the state is unchanged)."""
        return not self.terminated and bool(self._matcher.accept_token(int(token)))

    @property
    def terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


def _tokenizer_info(model_dir: Path, vocab_size: int, stop_token_ids: Iterable[int]) -> Any:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    ggufs = sorted(model_dir.glob("*.gguf"))
    if (model_dir / "tokenizer.json").is_file() or not ggufs:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    else:  # a folder with only a GGUF: its vocabulary is in the GGUF's metadata (slower to read)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), gguf_file=ggufs[0].name)
    return xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(set(stop_token_ids)) or None
    )


class Grammars:
    """One model's grammars: its tokenizer prepared once, each spec compiled once, off the caller's
    thread. `constraint(spec)` is None until the spec's grammar is ready."""

    def __init__(self, model_dir: Path, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        self._model_dir, self._vocab_size = Path(model_dir), vocab_size
        self._stop_token_ids = tuple(stop_token_ids)
        self._compiler: Any = None  # made on the compile thread by the first spec
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._compiled: OrderedDict[StructuredOutput, Future] = OrderedDict()

    def _compile(self, spec: StructuredOutput) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            info = _tokenizer_info(self._model_dir, self._vocab_size, self._stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return compile_spec(self._compiler, spec)

    def start(self, spec: StructuredOutput) -> Future:
        """Compile the spec in the background (once: later requests share the result)."""
        future = self._compiled.get(spec)
        if future is None:
            future = self._compiled[spec] = self._pool.submit(self._compile, spec)
            while len(self._compiled) > KEPT_GRAMMARS:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(spec)
        return future

    def constraint(self, spec: StructuredOutput) -> TokenConstraint | None:
        """A fresh matcher for the spec, or None while it compiles; raises GrammarError when the spec
        does not compile (and forgets it, so a fixed retry is compiled anew)."""
        future = self.start(spec)
        if not future.done():
            return None
        try:
            compiled = future.result()
        except GrammarError:
            self._compiled.pop(spec, None)
            raise
        except Exception as error:  # the tokenizer could not be prepared: every spec fails alike
            self._compiled.pop(spec, None)
            raise GrammarError(f"structured output is unavailable for this model: {error}") from None
        return TokenConstraint(compiled, self._vocab_size)

    def wait(self, spec: StructuredOutput, timeout_s: float | None) -> None:
        """Block up to timeout_s for a spec's grammar (an idle engine waits here, not in a busy loop)."""
        future = self.start(spec)
        try:
            future.exception(timeout=timeout_s)
        except TimeoutError:
            pass

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
