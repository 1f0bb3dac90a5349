"""llama-cpp-python's own API doing what the llama.cpp engine does on a CPU, the reference its tests
compare to: the GGUF as the engine serves it (llamacpp/weights.py: Q4_1 re-encoded to F16) decodes,
and a prompt of PREFILL_APART_MIN_TOKENS or more is prefilled but its last token on the F16 copy,
whose sequence state (llama_state_seq_get_data / set_data) then goes to the decoding model."""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp

from fleet_worker.engines.llamacpp.prefill import PREFILL_APART_MIN_TOKENS
from fleet_worker.engines.llamacpp.weights import served_gguf


class LlamaCppReference:
    def __init__(self, gguf: Path, n_ctx: int = 2048, weight_type: str = "auto") -> None:
        self.decoder = llama_cpp.Llama(
            model_path=str(served_gguf(gguf, weight_type)), n_ctx=n_ctx, n_threads=2, verbose=False
        )
        self.prefiller = llama_cpp.Llama(
            model_path=str(served_gguf(gguf, "F16")), n_ctx=n_ctx, n_threads=2, verbose=False
        )

    def tokenize(self, text: str) -> tuple[int, ...]:
        return tuple(self.decoder.tokenize(text.encode(), add_bos=False, special=True))

    def greedy(self, prompt: tuple[int, ...] | list[int], max_tokens: int, apart: bool = True) -> list[int]:
        """Greedy tokens from llama-cpp-python's generate loop, up to an end-of-generation token;
        apart=False: all on the decode weights (the engine's prefill_weight_type="none")."""
        prompt = list(prompt)
        self.decoder.reset()
        if apart and len(prompt) - 1 >= PREFILL_APART_MIN_TOKENS:
            self._prefill_apart(prompt[:-1])
        vocab = llama_cpp.llama_model_get_vocab(self.decoder.model)
        out: list[int] = []
        # generate() keeps the decoder's tokens that match the prompt's start and feeds the rest
        for token in self.decoder.generate(prompt, top_k=1, temp=0.0, reset=True):
            if llama_cpp.llama_vocab_is_eog(vocab, token) or len(out) == max_tokens:
                break
            out.append(token)
        return out

    def _prefill_apart(self, head: list[int]) -> None:
        self.prefiller.reset()
        self.prefiller.eval(head)
        source, target = self.prefiller._ctx.ctx, self.decoder._ctx.ctx
        size = llama_cpp.llama_state_seq_get_size(source, 0)
        buffer = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(source, buffer, size, 0)
        assert llama_cpp.llama_state_seq_set_data(target, buffer, written, 0) == written
        self.decoder.input_ids[: len(head)] = head
        self.decoder.n_tokens = len(head)
