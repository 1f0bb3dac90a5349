"""Which prefill partner `fleet up` adds beside the model's decoder (pure)."""

from fleet_local.bootstrap import wants_prefill_partner

LLAMACPP, MLX = {"engine": "llamacpp"}, {"engine": "mlx"}


def test_auto_pairs_vllm_with_a_llama_cpp_decoder_only_where_vllm_is_installed() -> None:
    assert wants_prefill_partner(LLAMACPP, "auto", vllm_installed=True) == "vllm"
    assert wants_prefill_partner(LLAMACPP, "auto", vllm_installed=False) == ""
    assert wants_prefill_partner(MLX, "auto", vllm_installed=True) == ""  # e.g. Apple Silicon's MLX


def test_none_adds_nothing_and_a_named_engine_is_taken_as_asked() -> None:
    assert wants_prefill_partner(LLAMACPP, "none", vllm_installed=True) == ""
    assert wants_prefill_partner(MLX, "vllm", vllm_installed=False) == "vllm"
