"""A fake model catalog for route tests (named as a fake): every name resolves to one model."""

from __future__ import annotations

from fleet_gateway.models import ModelInfo


class FakeCatalog:
    def __init__(self, model: ModelInfo) -> None:
        self.model = model

    async def get(self, model_id: str) -> ModelInfo:
        return self.model
