"""MlxEngine on real MLX (CPU) with a tiny random llama, checked against mlx-lm's own generation."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step, stream_generate

from fleet_proto import SamplingParams
from fleet_worker.engines.base import EngineOutput, EngineRequest, load_engine
from fleet_worker.engines.mlx.engine import MlxEngine

from .tiny_model import EOS_ID, make_tiny_llama

pytestmark = pytest.mark.unit

PROMPTS = [
    [5, 6, 7, 8, 9],
    [100],
    [300, 301, 302],
    list(range(40, 60)),
    [7, 7, 7],
    [1, 2, 3, 4],
    list(range(200, 290)),
    [11, 12],
]


def greedy(max_tokens: int = 16, **kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)  # type: ignore[arg-type]


def request(request_id: str, prompt: list[int], sampling: SamplingParams | None = None) -> EngineRequest:
    return EngineRequest(request_id=request_id, prompt_token_ids=tuple(prompt), sampling=sampling or greedy())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> tuple[object, object]:
    model, tokenizer = mlx_lm.load(str(model_dir))
    return model, tokenizer


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[MlxEngine]:
    engine = MlxEngine(model_dir, max_batch_size=8, prefill_step_size=16)
    yield engine
    engine.close()


def reference_greedy(reference: tuple[object, object], prompt: list[int], max_tokens: int = 16) -> list[int]:
    model, _ = reference
    return [token for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)]


Tokens = dict[str, list[int]]


def run(engine: MlxEngine, requests: Sequence[EngineRequest] = ()) -> tuple[Tokens, dict[str, EngineOutput]]:
    """Add the requests, step until idle; tokens and final output of every request seen."""
    for r in requests:
        engine.add(r)
    tokens: Tokens = {}
    final: dict[str, EngineOutput] = {}
    for _ in range(1000):
        if not engine.has_work():
            break
        for output in engine.step():
            assert output.request_id not in final, "output after the final one"
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
            if output.finish_reason:
                final[output.request_id] = output
    assert not engine.has_work()
    return tokens, final


def test_registry_builds_the_mlx_engine(model_dir: Path):
    engine = load_engine("mlx", model_dir, max_batch_size=2)
    assert isinstance(engine, MlxEngine)
    assert engine.max_batch_size == 2
    assert EOS_ID in engine.eos_token_ids
    engine.close()


def test_greedy_equals_mlx_lm_generation(engine: MlxEngine, reference: tuple[object, object]):
    model, tokenizer = reference
    prompt = PROMPTS[0]
    expected = [r.token for r in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=16)]
    assert expected == reference_greedy(reference, prompt)
    assert len(set(expected)) > 3  # the tiny model does not just repeat one token

    tokens, final = run(engine, [request("a", prompt)])
    assert tokens["a"] == expected
    out = final["a"]
    assert (out.finish_reason, out.completion_tokens, out.prompt_tokens) == ("length", 16, len(prompt))
    assert out.prompt_time_s > 0 and out.decode_time_s > 0


def test_eight_concurrent_requests_each_equal_their_single_run(
    engine: MlxEngine, reference: tuple[object, object]
):
    lengths = [16, 4, 9, 16, 1, 12, 7, 16]
    pairs = enumerate(zip(PROMPTS, lengths, strict=True))
    expected = {str(i): reference_greedy(reference, p, n) for i, (p, n) in pairs}
    # Half join at once, the rest one per step while the first ones decode.
    for i in range(4):
        engine.add(request(str(i), PROMPTS[i], greedy(lengths[i])))
    tokens: Tokens = {}
    final: dict[str, EngineOutput] = {}
    for step in range(100):
        if 4 + step < len(PROMPTS):
            engine.add(request(str(4 + step), PROMPTS[4 + step], greedy(lengths[4 + step])))
        elif not engine.has_work():
            break
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
            if output.finish_reason:
                final[output.request_id] = output
    assert tokens == expected
    assert {k: (o.finish_reason, o.completion_tokens) for k, o in final.items()} == {
        str(i): ("length", n) for i, n in enumerate(lengths)
    }


def test_long_prompts_report_prefill_progress_per_chunk(model_dir: Path, reference: tuple[object, object]):
    progress: list[EngineOutput] = []
    engine = MlxEngine(model_dir, prefill_step_size=16, on_prefill_progress=progress.append)
    long, short = PROMPTS[6], PROMPTS[0]  # 90 and 5 tokens, prefilled together
    try:
        tokens, _ = run(engine, [request("long", long), request("short", short)])
    finally:
        engine.close()
    assert tokens == {"long": reference_greedy(reference, long), "short": reference_greedy(reference, short)}
    # 89 tokens fill the cache (the last one is sampled from): after each of the first five chunks of 16
    # the prompt is unfinished; the short prompt ends inside its first chunk and reports nothing.
    assert [(p.request_id, p.prefilled_tokens, p.prompt_tokens) for p in progress] == [
        ("long", n, 90) for n in (16, 32, 48, 64, 80)
    ]
    assert all(not p.token_ids and not p.finish_reason for p in progress)


def test_every_running_request_advances_one_token_per_step(engine: MlxEngine):
    for i in range(3):
        engine.add(request(f"s{i}", PROMPTS[i], greedy(5)))
    first = engine.step()  # prefill and first token of all three
    assert sorted((o.request_id, len(o.token_ids)) for o in first) == [("s0", 1), ("s1", 1), ("s2", 1)]
    engine.add(request("late", PROMPTS[3], greedy(5)))
    second = sorted((o.request_id, len(o.token_ids)) for o in engine.step())
    assert second == [("late", 1), ("s0", 1), ("s1", 1), ("s2", 1)]
    run(engine)


def test_max_batch_size_queues_the_rest(model_dir: Path, reference: tuple[object, object]):
    engine = MlxEngine(model_dir, max_batch_size=2)
    try:
        for i in range(5):
            engine.add(request(str(i), PROMPTS[i], greedy(6)))
        first = engine.step()
        assert {o.request_id for o in first} == {"0", "1"}
        tokens, final = run(engine)
    finally:
        engine.close()
    for output in first:
        tokens[output.request_id][:0] = output.token_ids
    assert tokens == {str(i): reference_greedy(reference, PROMPTS[i], 6) for i in range(5)}
    assert {o.finish_reason for o in final.values()} == {"length"}


def test_max_tokens_gives_length_with_exactly_that_many_tokens(engine: MlxEngine):
    tokens, final = run(engine, [request("n3", PROMPTS[2], greedy(3)), request("n1", PROMPTS[5], greedy(1))])
    assert len(tokens["n3"]) == 3 and len(tokens["n1"]) == 1
    assert final["n3"].finish_reason == final["n1"].finish_reason == "length"


def test_stop_token_ends_with_stop_and_is_not_returned(engine: MlxEngine, reference: tuple[object, object]):
    expected = reference_greedy(reference, PROMPTS[3])
    stop = expected[5]
    cut = expected.index(stop)
    tokens, final = run(engine, [request("s", PROMPTS[3], greedy(16, stop_token_ids=(stop,)))])
    assert tokens["s"] == expected[:cut]
    assert final["s"].finish_reason == "stop"
    assert final["s"].completion_tokens == cut + 1  # the stop token was generated, not returned


def test_eos_of_generation_config_stops(model_dir: Path, tmp_path: Path, reference: tuple[object, object]):
    expected = reference_greedy(reference, PROMPTS[0])
    folder = shutil.copytree(model_dir, tmp_path / "model")
    eos = expected[3]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS_ID, eos]}))
    engine = MlxEngine(folder)
    try:
        assert {EOS_ID, eos} <= engine.eos_token_ids
        tokens, final = run(engine, [request("e", PROMPTS[0])])
    finally:
        engine.close()
    assert tokens["e"] == expected[: expected.index(eos)]
    assert final["e"].finish_reason == "stop"


def test_ignore_eos_generates_through_end_of_sequence(
    model_dir: Path, tmp_path: Path, reference: tuple[object, object]
):
    expected = reference_greedy(reference, PROMPTS[0])
    folder = shutil.copytree(model_dir, tmp_path / "model")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS_ID, expected[3]]}))
    engine = MlxEngine(folder)
    try:
        tokens, final = run(engine, [request("e", PROMPTS[0], greedy(16, ignore_eos=True))])
    finally:
        engine.close()
    assert tokens["e"] == expected and final["e"].finish_reason == "length"


def test_cancel_frees_the_slot(model_dir: Path, reference: tuple[object, object]):
    engine = MlxEngine(model_dir, max_batch_size=1)
    try:
        engine.add(request("running", PROMPTS[0]))
        engine.add(request("queued", PROMPTS[1]))
        engine.add(request("also-queued", PROMPTS[2]))
        assert [o.request_id for o in engine.step()] == ["running"]
        engine.cancel("also-queued")  # never started
        engine.cancel("running")
        engine.cancel("unknown")  # ignored
        outputs = {o.request_id: o for o in engine.step()}
        assert outputs["also-queued"].finish_reason == "cancelled"
        assert outputs["running"].finish_reason == "cancelled"
        assert outputs["running"].completion_tokens == 1
        assert outputs["queued"].token_ids  # admitted into the freed slot in the same step
        tokens, _ = run(engine)
        assert not engine.has_work()
        queued = list(outputs["queued"].token_ids) + tokens["queued"]
        assert queued == reference_greedy(reference, PROMPTS[1])
        tokens, _ = run(engine, [request("after", PROMPTS[4], greedy(4))])
        assert tokens["after"] == reference_greedy(reference, PROMPTS[4], 4)
    finally:
        engine.close()


def test_seeded_sampling_is_reproducible_alone(engine: MlxEngine):
    def sample(request_id: str, seed: int, **kwargs: float) -> list[int]:
        params = SamplingParams(temperature=0.8, max_tokens=16, seed=seed, **kwargs)  # type: ignore[arg-type]
        return run(engine, [request(request_id, PROMPTS[0], params)])[0][request_id]

    first, again, other = sample("a", 1234), sample("b", 1234), sample("c", 4321)
    assert first == again
    assert first != other
    filtered = {"top_p": 0.9, "top_k": 50, "min_p": 0.05, "repetition_penalty": 1.3}
    assert sample("d", 7, **filtered) == sample("e", 7, **filtered)
    assert len(sample("f", 7, **filtered)) == 16


def test_bad_request_fails_alone(engine: MlxEngine, reference: tuple[object, object]):
    tokens, final = run(
        engine,
        [
            request("good", PROMPTS[0], greedy(8)),
            request("bad-token", [5, 100_000]),
            request("empty", []),
            request("bad-top-p", PROMPTS[0], SamplingParams(top_p=0.0)),
        ],
    )
    assert tokens["good"] == reference_greedy(reference, PROMPTS[0], 8)
    assert "outside the vocabulary" in final["bad-token"].error
    assert final["empty"].error == "empty prompt"
    assert "top_p" in final["bad-top-p"].error
    assert {final[k].finish_reason for k in ("bad-token", "empty", "bad-top-p")} == {"error"}


def test_failing_sampler_fails_only_its_request(engine: MlxEngine, reference: tuple[object, object]):
    def broken(logprobs: mx.array) -> mx.array:
        raise RuntimeError("sampler broke")

    engine.add(request("ok", PROMPTS[1], greedy(6)))
    engine.add(request("broken", PROMPTS[2], greedy(6)))
    engine._live["broken"].sampler = broken  # a fault inside one request's processing
    tokens, final = run(engine)
    assert final["broken"].finish_reason == "error"
    assert "sampler broke" in final["broken"].error
    assert tokens["ok"] == reference_greedy(reference, PROMPTS[1], 6)


def test_logprobs_are_mlx_lm_log_softmax_with_the_top_tokens(
    engine: MlxEngine, reference: tuple[object, object]
):
    model, _ = reference
    prompt = PROMPTS[3]
    steps = list(zip(generate_step(mx.array(prompt), model, max_tokens=6), range(6), strict=False))
    expected = [(token, row.astype(mx.float32)) for (token, row), _ in steps]
    engine.add(request("lp", prompt, greedy(6, logprobs=3)))
    engine.add(request("none", prompt, greedy(6)))
    scored, plain = [], []
    while engine.has_work():
        for output in engine.step():
            (scored if output.request_id == "lp" else plain).extend(output.logprobs)
    assert plain == [] and [s.token_id for s in scored] == [token for token, _ in expected]
    for score, (token, row) in zip(scored, expected, strict=True):
        top = mx.argsort(-row)[:3].tolist()
        assert score.logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert list(score.top_ids) == top and score.top_ids[0] == token  # greedy: the likeliest
        assert list(score.top_logprobs) == pytest.approx([row[i].item() for i in top], abs=1e-4)


def continued(
    request_id: str, prompt: list[int], sampling: SamplingParams, generated: list[int]
) -> EngineRequest:
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=tuple(prompt),
        sampling=sampling,
        generated_token_ids=tuple(generated),
    )


def test_a_continuation_goes_on_exactly_as_the_uninterrupted_run(engine: MlxEngine):
    prompt = PROMPTS[3]
    seeded = SamplingParams(
        temperature=0.9, max_tokens=16, seed=21, top_p=0.95, min_tokens=12,
        repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3,
    )  # fmt: skip
    least = greedy(8, min_tokens=5, logit_bias=((EOS_ID, 100.0),))  # 5 tokens, then EOS
    for name, sampling in (("greedy", greedy(16)), ("seeded", seeded), ("least", least)):
        whole, final = run(engine, [request(name, prompt, sampling)])
        expected = (final[name].finish_reason, final[name].completion_tokens, len(prompt))
        for at in (1, 9):  # each alone: a batch's padded forward pass may round otherwise
            tokens, ends = run(engine, [continued(f"{name}{at}", prompt, sampling, whole[name][:at])])
            assert tokens[f"{name}{at}"] == whole[name][at:], (name, at)
            end = ends[f"{name}{at}"]
            assert (end.finish_reason, end.completion_tokens, end.prompt_tokens) == expected
    tokens, ends = run(engine, [continued("spent", prompt, greedy(4), [9, 8, 7, 6])])
    assert tokens["spent"] == []
    assert (ends["spent"].finish_reason, ends["spent"].completion_tokens) == ("length", 4)
