"""A tiny byte-level BPE model folder (SmolLM2-like: ChatML template, same special token ids) for tests.

Trained in a few milliseconds from a built-in corpus; the same files on every run.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2
VOCAB_SIZE = 400

# SmolLM2-Instruct's template: ChatML with a default system prompt.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face.",
    "system user assistant: Hello! How can I help you today?",
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.",
    "What is the capital of France? The capital of France is Paris.",
    "Write a short poem about the sea, the wind and the stars at night.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000;",
    "symbols: ! ? , . ; : ( ) [ ] { } < > / \\ | - _ + = * & % $ # @",
    "Stop words like END and STOP, new lines\nand tabs\tappear in text too.",
    "Unicode: café, naïve, über, São Paulo, 東京, 北京, こんにちは, привет, 🙂🚀👍🏽, ∑ ∫ √ π.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    '{"role": "user", "content": "tell me a joke"}',
]


def build_tiny_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tokenizer


def make_tiny_tokenizer_folder(folder: Path, extra_special_tokens: tuple[str, ...] = ()) -> Path:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json into `folder`; extra
    special tokens (e.g. Harmony's) get the ids after the trained vocabulary."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens(list(extra_special_tokens))
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|im_end|>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "model_max_length": 2048,
        "chat_template": CHATML_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    generation = {"bos_token_id": IM_START_ID, "eos_token_id": IM_END_ID}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2), encoding="utf-8")
    return folder
