"""MlxEmbedder on all-MiniLM-L6-v2 (CPU): its vectors equal sentence-transformers' own, concurrent
requests share forward passes without changing a vector, and bad requests end in errors.

mlx is imported only by load_engine, after the engine's OpenBLAS is loaded (cpu_blas): importing it
here first would leave MLX on its slow bundled BLAS.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from fleet_worker.engines.base import INVALID_REQUEST, Engine, EngineOutput, EngineRequest, load_engine

from .minilm import MIN_COSINE, TEXTS, cosines, minilm_folder, reference_vectors, token_inputs

Inputs = Sequence[tuple[int, ...]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return minilm_folder(tmp_path_factory.mktemp("minilm"))


@pytest.fixture(scope="module")
def inputs(folder: Path) -> list[tuple[int, ...]]:
    return token_inputs(folder)


@pytest.fixture(scope="module")
def load_calls() -> list[tuple[int, int]]:
    return []


@pytest.fixture(scope="module")
def engine(folder: Path, load_calls: list[tuple[int, int]]) -> Iterator[Engine]:
    engine = load_engine(
        "mlx", folder, on_load_progress=lambda *call: load_calls.append(call), embedding=True
    )
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def small_batches(folder: Path) -> Iterator[Engine]:
    """At most 4 inputs per forward pass: requests of 6 inputs take several steps."""
    engine = load_engine("mlx", folder, embedding=True, max_batch_inputs=4)
    yield engine
    engine.close()


def embed_request(request_id: str, inputs: Inputs) -> EngineRequest:
    return EngineRequest(request_id=request_id, prompt_token_ids=(), embed_inputs=tuple(inputs))


def run(engine: Engine, requests: Sequence[EngineRequest] = ()) -> tuple[dict[str, EngineOutput], int]:
    """Add the requests and step until idle: every request's final output, and the steps taken."""
    for request in requests:
        engine.add(request)
    final: dict[str, EngineOutput] = {}
    steps = 0
    while engine.has_work():
        steps += 1
        for output in engine.step():
            assert output.finish_reason, "an embedding request has one output, its final one"
            assert output.request_id not in final, "output after the final one"
            final[output.request_id] = output
    return final, steps


def vectors(output: EngineOutput) -> np.ndarray:
    return np.stack([np.frombuffer(vector, dtype="<f4") for vector in output.embeddings])


def test_vectors_equal_sentence_transformers(
    engine: Engine, folder: Path, inputs: list[tuple[int, ...]], load_calls: list[tuple[int, int]]
):
    final, steps = run(engine, [embed_request("all", inputs)])
    out = final["all"]
    # two forward passes: the 182-token input apart from the short ones
    assert (out.finish_reason, out.prompt_tokens, steps) == ("stop", sum(map(len, inputs)), 2)
    assert out.prompt_time_s > 0
    got = vectors(out)
    assert got.shape == (len(TEXTS), 384)
    assert cosines(got, reference_vectors(folder)).min() >= MIN_COSINE
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # the model's Normalize module
    assert load_calls[-1] == (6, 6) and len(load_calls) == 6  # one call per layer


def test_concurrent_requests_share_steps_and_keep_each_vector(
    engine: Engine, small_batches: Engine, inputs: list[tuple[int, ...]]
):
    alone = [
        vectors(run(engine, [embed_request(f"one-{i}", [tokens])])[0][f"one-{i}"])
        for i, tokens in enumerate(inputs)
    ]
    # 3 requests of 1, 3 and 2 inputs, twice over: 12 inputs, at most 4 per step
    sizes = [(0, 1), (1, 4), (4, 6)]
    requests = [embed_request(f"{round_}-{a}", inputs[a:b]) for round_ in range(2) for a, b in sizes]
    final, steps = run(small_batches, requests)
    # 12 inputs in 4 forward passes: 4 of 9 tokens, 4 of 14-15, then the 6s apart from the 182s
    assert steps == 4
    for round_ in range(2):
        for a, b in sizes:
            out = final[f"{round_}-{a}"]
            assert out.finish_reason == "stop" and out.prompt_tokens == sum(map(len, inputs[a:b]))
            assert np.allclose(vectors(out), np.concatenate(alone[a:b]), atol=1e-5)


def test_a_batch_takes_the_oldest_input_then_those_of_similar_length_nearest_it():
    from fleet_worker.engines.mlx.embedding import plan_batch  # after the engine fixtures (module doc)

    assert plan_batch([10, 200, 12, 198, 11], max_tokens=8192, max_inputs=3) == [0, 2, 4]
    assert plan_batch([9, 182, 15, 6, 30], max_tokens=8192, max_inputs=8) == [0, 2, 3]  # 6 to 22 tokens
    assert plan_batch([40, 25, 50, 81], max_tokens=8192, max_inputs=8) == [0, 1, 2]  # within 2x of 25
    assert plan_batch([200, 198, 199], max_tokens=400, max_inputs=8) == [0, 2]  # 3 x 200 padded is over
    assert plan_batch([600], max_tokens=512, max_inputs=8) == [0]  # the oldest goes even over budget
    assert plan_batch([], max_tokens=512, max_inputs=8) == []


def test_pooling_reads_only_each_rows_real_tokens(engine: Engine):
    import mlx.core as mx  # after the engine fixture (module doc)

    from fleet_worker.engines.mlx.embedding import pooled

    hidden = mx.array([[[1.0], [2.0], [6.0]], [[4.0], [99.0], [99.0]]])  # row 1: one real token
    lengths = mx.array([3, 1])
    assert pooled(hidden, lengths, "mean").tolist() == [[3.0], [4.0]]
    assert pooled(hidden, lengths, "cls").tolist() == [[1.0], [4.0]]
    assert pooled(hidden, lengths, "last").tolist() == [[6.0], [4.0]]


@pytest.mark.parametrize(
    ("request_", "problem"),
    [
        (embed_request("none", []), "no inputs to embed"),
        (embed_request("empty", [(101, 102), ()]), "input 1 is empty"),
        (embed_request("vocab", [(101, 30522, 102)]), "token id 30522 is outside the vocabulary of 30522"),
        (embed_request("long", [(101,) * 257]), "input 0 has 257 tokens; this model embeds at most 256"),
        (EngineRequest(request_id="prompt", prompt_token_ids=(101, 102)), "serves embeddings only"),
    ],
)
def test_bad_requests_end_in_an_invalid_request_error(engine: Engine, request_: EngineRequest, problem: str):
    final, _ = run(engine, [request_])
    out = final[request_.request_id]
    assert (out.finish_reason, out.error_kind, out.embeddings) == ("error", INVALID_REQUEST, ())
    assert problem in out.error


def test_cancel_drops_waiting_inputs(small_batches: Engine, inputs: list[tuple[int, ...]]):
    small_batches.add(embed_request("partly", inputs))  # 6 inputs: its 4 shortest in the first step
    small_batches.add(embed_request("waiting", inputs[5:]))  # as long as partly's longest: after it
    assert small_batches.step() == []
    small_batches.cancel("partly")
    small_batches.cancel("unknown")
    final, _ = run(small_batches)
    assert final["partly"].finish_reason == "cancelled" and final["partly"].embeddings == ()
    assert final["waiting"].finish_reason == "stop" and len(final["waiting"].embeddings) == 1


def test_throughput_against_sentence_transformers(
    engine: Engine, folder: Path, inputs: list[tuple[int, ...]]
):
    """Not asserted: inputs/s of one request of 32 inputs, and of sentence-transformers' encode."""
    from sentence_transformers import SentenceTransformer

    batch = (inputs * 6)[:32]
    texts = list((TEXTS * 6)[:32])
    model = SentenceTransformer(str(folder), device="cpu")
    model.encode(texts, batch_size=32)
    run(engine, [embed_request("warm", batch)])
    rounds = 3
    started = time.perf_counter()
    for round_ in range(rounds):
        run(engine, [embed_request(f"timed-{round_}", batch)])
    mlx_rate = rounds * len(batch) / (time.perf_counter() - started)
    started = time.perf_counter()
    for _ in range(rounds):
        model.encode(texts, batch_size=32)
    st_rate = rounds * len(texts) / (time.perf_counter() - started)
    print(f"\nbatch of 32: MlxEmbedder {mlx_rate:.1f} inputs/s, sentence-transformers {st_rate:.1f} inputs/s")
