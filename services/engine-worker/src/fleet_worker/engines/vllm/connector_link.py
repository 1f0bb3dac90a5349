"""The vLLM engine's one way to Fleet's KV connector object (connector.py).

vLLM builds the connector from `kv_transfer_config` and keeps its worker-side instance to itself
(process-global: `get_kv_transfer_group`). Four things the engine needs of Fleet's connector have
no call in vLLM's connector API: write the prompt blocks saved in the last step once the step's
tokens are out (so block writes never hold a token back), end an export whose first token the
engine sampled (the token is the engine's output, not the connector's), forget a cancelled
export, and how far a long prompt's prefill has come (its progress lines). They go through
`ConnectorLink`, the only code that reaches the connector object; it checks that the connector
is Fleet's.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

from fleet_worker.engines.vllm.connector import FleetKVConnector


class ConnectorLink:
    def __init__(self, connector: FleetKVConnector) -> None:
        self._connector = connector

    @classmethod
    def find(cls) -> ConnectorLink | None:
        """The link to this process's worker-side connector; None without one (no kv_dir)."""
        if not has_kv_transfer_group():
            return None
        connector = get_kv_transfer_group()
        if not isinstance(connector, FleetKVConnector):
            raise TypeError(f"vLLM's KV connector is a {type(connector).__name__}, not Fleet's")
        return cls(connector)

    def write_saved_blocks(self) -> int:
        return self._connector.write_saved_blocks()

    def finish_export(self, folder: str, handoff_id: str, start_pos: int, end: int, first_token: int) -> None:
        self._connector.finish_export(folder, handoff_id, start_pos, end, first_token)

    def drop_export(self, handoff_id: str) -> None:
        self._connector.drop_export(handoff_id)

    def computed_tokens(self, request_id: str) -> int:
        return self._connector.computed_tokens(request_id)
