"""The vLLM engine's pure parts, without vLLM: sampling mapping, stop-token trimming, paged layouts
(with a fake cache-write op named as such), and the worker's engine options."""

from __future__ import annotations

import pytest
import torch

from fleet_proto import SamplingParams, StructuredOutput
from fleet_store import ManifestFile, ModelManifest
from fleet_store.kv import manifest_fingerprint, model_fingerprint
from fleet_worker.engine_options import EngineOptionsError, KVSettings, engine_options, parse_engine_options
from fleet_worker.engines.vllm.paged import ProbedPositions, SplitLastDim
from fleet_worker.engines.vllm.sampling import (
    RESUMED_PENALTIES,
    emitted_tokens,
    resumed_seed,
    structured_outputs_fields,
    vllm_sampling_kwargs,
)

pytestmark = pytest.mark.unit


def test_sampling_maps_like_the_seed() -> None:
    params = SamplingParams(
        max_tokens=50, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1, seed=3,
        stop_token_ids=(7,), logprobs=2, presence_penalty=0.5, frequency_penalty=-0.5,
        logit_bias=((4, 1.5),), min_tokens=3,
    )  # fmt: skip
    kwargs = vllm_sampling_kwargs(params, prompt_tokens=10, max_model_len=100, eos_token_ids=[2, 9])
    assert kwargs == {
        "max_tokens": 50, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
        "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "logit_bias": {4: 1.5}, "min_tokens": 3, "seed": 3, "stop_token_ids": [2, 7, 9], "logprobs": 2,
        "detokenize": False, "skip_special_tokens": False, "ignore_eos": False,
    }  # fmt: skip


def test_a_structured_output_reaches_vllm_as_the_grammar_fleet_compiles() -> None:
    fields = structured_outputs_fields(StructuredOutput(choice=("a", "b")))
    assert fields == {"grammar": 'root ::= "a" | "b"'}
    schema = structured_outputs_fields(StructuredOutput(json_schema='{"type": "object"}'))
    assert list(schema) == ["grammar"] and "root ::=" in schema["grammar"]
    assert structured_outputs_fields(StructuredOutput(structural_tag="{}")) == {"structural_tag": "{}"}


def test_ignore_eos_keeps_only_the_asked_stop_tokens() -> None:
    params = SamplingParams(stop_token_ids=(7,), ignore_eos=True)
    kwargs = vllm_sampling_kwargs(params, prompt_tokens=10, max_model_len=100, eos_token_ids=[2, 9])
    assert kwargs["stop_token_ids"] == [7] and kwargs["ignore_eos"] is True


def test_max_tokens_is_clamped_to_the_room_left_in_the_context() -> None:
    kwargs = vllm_sampling_kwargs(
        SamplingParams(max_tokens=500), prompt_tokens=90, max_model_len=100, eos_token_ids=[]
    )
    assert kwargs["max_tokens"] == 10 and "logprobs" not in kwargs


def test_a_continuation_counts_its_generated_tokens_and_is_seeded_anew() -> None:
    params = SamplingParams(max_tokens=50, min_tokens=8, seed=3, temperature=0.7, frequency_penalty=0.5)
    kwargs = vllm_sampling_kwargs(
        params, prompt_tokens=10, max_model_len=100, eos_token_ids=[2], generated=[5] * 6
    )
    assert (kwargs["max_tokens"], kwargs["min_tokens"]) == (44, 2)
    assert kwargs["seed"] == resumed_seed(3, 6) not in (3, resumed_seed(3, 7), resumed_seed(4, 6))
    # the frequency penalty must count the generated tokens: Fleet's processor applies all three
    assert (kwargs["repetition_penalty"], kwargs["frequency_penalty"], kwargs["presence_penalty"]) == (
        1.0,
        0.0,
        0.0,
    )
    resumed = {"generated": 6, "repetition": 1.0, "frequency": 0.5, "presence": 0.0}
    assert kwargs["extra_args"] == {RESUMED_PENALTIES: resumed}
    plain = vllm_sampling_kwargs(
        SamplingParams(seed=3), prompt_tokens=10, max_model_len=100, eos_token_ids=[2]
    )
    assert plain["seed"] == 3 and "extra_args" not in plain


def test_the_stop_token_is_dropped_only_when_it_stopped_the_request() -> None:
    stops = frozenset({2})
    assert emitted_tokens([5, 2], "stop", stops) == [5]
    assert emitted_tokens([5, 2], "length", stops) == [5, 2]  # hit max_tokens on it: keep
    assert emitted_tokens([5], "", stops) == [5]


def fake_transposed_key_write(key, value, key_cache, value_cache, slots) -> None:
    """A fake of vLLM's CPU cache-write op (AVX2 "vec" layout): keys [dim, block] per head, values rows."""
    block_size = key_cache.shape[2]
    for i, slot in enumerate(slots.tolist()):
        block, row = divmod(slot, block_size)
        for head in range(key.shape[1]):
            flat = key_cache[block, head].reshape(-1) if key_cache[block, head].is_contiguous() else None
            assert flat is not None
            flat.view(-1, block_size)[:, row] = key[i, head]  # key dims go down the columns
            value_cache[block, head, row] = value[i, head]


def test_probed_positions_find_where_the_backend_put_each_row() -> None:
    heads, block_size, dim = 2, 4, 3
    layout = ProbedPositions.probe(fake_transposed_key_write, heads, block_size, dim, torch.bfloat16)
    assert layout.key_positions[1, 2].item() == 2 * block_size + 1  # transposed: dim 2, row 1
    assert layout.value_positions[1, 2].item() == block_size * dim + 1 * dim + 2  # after the keys

    cache = torch.zeros(3, heads, block_size, 2 * dim)
    keys, values = torch.randn(5, heads, dim), torch.randn(5, heads, dim)
    slots = torch.tensor([1, 2, 3, 8, 9])
    layout.scatter(cache, slots, keys, values)
    # what the fake op writes for the same rows is what the layout wrote
    expected = torch.zeros_like(cache)
    key_cache, value_cache = expected.view(3, heads, 2 * block_size, dim).chunk(2, dim=2)
    fake_transposed_key_write(keys, values, key_cache, value_cache, slots)
    assert torch.equal(cache, expected)
    got_keys, got_values = layout.gather(cache, slots)
    assert torch.equal(got_keys, keys) and torch.equal(got_values, values)


def test_split_last_dim_round_trips_rows() -> None:
    cache = torch.zeros(4, 2, 8, 2 * 16)
    keys, values = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    slots = torch.tensor([0, 9, 31])
    SplitLastDim().scatter(cache, slots, keys, values)
    assert torch.equal(cache[1, :, 1, :16], keys[1]) and torch.equal(cache[1, :, 1, 16:], values[1])
    got_keys, got_values = SplitLastDim().gather(cache, slots)
    assert torch.equal(got_keys, keys) and torch.equal(got_values, values)


def test_engine_options_come_from_json_per_engine() -> None:
    assert parse_engine_options("") == {}
    assert parse_engine_options('{"vllm": {"kv_cache_bytes": 5}}') == {"vllm": {"kv_cache_bytes": 5}}
    for bad in ("{", '["vllm"]', '{"vllm": 3}'):
        with pytest.raises(EngineOptionsError):
            parse_engine_options(bad)


def test_a_kv_engine_gets_the_fingerprint_of_its_manifest() -> None:
    files = (
        ManifestFile(path="model.safetensors", size=1, sha256="ab"),
        ManifestFile(path="config.json", size=1, sha256="cd"),
    )
    manifest = ModelManifest(
        model_id="m", revision="main", source="test", files=files, config={}, created_at=0
    )
    assert manifest_fingerprint(manifest) == model_fingerprint({"model.safetensors": "ab"})
    options = engine_options({"vllm": {"kv_dir": "/kv"}}, "vllm", manifest)
    assert options == {"kv_dir": "/kv", "kv_fingerprint": manifest_fingerprint(manifest)}
    assert engine_options({"vllm": {"kv_dir": "/kv"}}, "mlx", manifest) == {}


def test_every_engine_gets_the_shared_kv_settings_and_configured_options_win() -> None:
    manifest = ModelManifest(model_id="m", revision="main", source="t", files=(), config={}, created_at=0)
    kv = KVSettings(folder="/state/kv", block_size=256, memory_bytes=1 << 30)
    mlx = engine_options({}, "mlx", manifest, kv)
    assert mlx == {
        "kv_dir": "/state/kv", "kv_block_size": 256, "kv_memory_bytes": 1 << 30,
        "kv_fingerprint": manifest_fingerprint(manifest),
    }  # fmt: skip
    vllm = engine_options({"vllm": {"kv_block_size": 512}}, "vllm", manifest, kv)
    assert vllm["kv_block_size"] == 512 and "kv_memory_bytes" not in vllm


def test_a_pipeline_rank_gets_the_memory_tier_and_no_kv_folder() -> None:
    manifest = ModelManifest(model_id="m", revision="main", source="t", files=(), config={}, created_at=0)
    kv = KVSettings(folder="/state/kv", block_size=256, memory_bytes=1 << 30)
    rank = engine_options({"mlx": {"kv_dir": "/elsewhere"}}, "mlx", manifest, kv, shared_tier=False)
    assert rank == {
        "kv_block_size": 256, "kv_memory_bytes": 1 << 30, "kv_fingerprint": manifest_fingerprint(manifest),
    }  # fmt: skip


def test_fp8_kv_pages_and_hybrid_models_get_no_connector_and_say_why() -> None:
    from types import SimpleNamespace

    from fleet_worker.engines.vllm.engine import connector_problem

    plain, hybrid = SimpleNamespace(is_hybrid=False), SimpleNamespace(is_hybrid=True)
    assert connector_problem(plain) == ""  # type: ignore[arg-type]
    assert "not scaled fp8 pages" in connector_problem(plain, "fp8_e4m3")  # type: ignore[arg-type]
    assert "hybrid" in connector_problem(hybrid)  # type: ignore[arg-type]
