"""Weight-loading progress for vLLM through its own extension point: a registered model loader.

vLLM picks a loader class by `load_format` from the registry that `register_model_loader` fills
(its documented way to plug in a loader). Fleet's loader is vLLM's DefaultModelLoader with the
weights iterator wrapped: each tensor name that starts a new `layers.<i>.` reports (layers seen,
total). No vLLM function is rebound, so nothing breaks silently when vLLM changes: if the
DefaultModelLoader contract changes, the test that loads a model and counts the reports fails.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator

from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

LOAD_FORMAT = "fleet-progress"
# `layers.<i>.` of decoders, `layer.<i>.` of BERT-style encoders (embedding models)
_LAYER = re.compile(r"(?:^|\.)layers?\.(\d+)\.")


def count_layers(
    weights: Iterator[tuple[str, object]], total: int, report: Callable[[int, int], None]
) -> Iterator[tuple[str, object]]:
    """Pass the weights through, reporting each newly seen layer index (and the end) as it goes."""
    seen: set[int] = set()
    for name, tensor in weights:
        yield name, tensor
        match = _LAYER.search(name)
        if match and int(match.group(1)) not in seen:
            seen.add(int(match.group(1)))
            report(min(len(seen), total), total)
    report(total, total)


def register_progress_loader(total_layers: int, report: Callable[[int, int], None]) -> str:
    """Register the reporting loader for this process's engine; returns the load_format to use.

    One engine per engine process, so re-registering (a warning in vLLM's log) never happens there.
    """

    class ProgressModelLoader(DefaultModelLoader):
        def __init__(self, load_config: LoadConfig) -> None:
            # The base picks weight files by load_format: Fleet stages safetensors only.
            super().__init__(dataclasses.replace(load_config, load_format="safetensors"))

        def get_all_weights(self, model_config, model):
            return count_layers(super().get_all_weights(model_config, model), total_layers, report)

    register_model_loader(LOAD_FORMAT)(ProgressModelLoader)
    return LOAD_FORMAT
