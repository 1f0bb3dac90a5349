"""A remote prefill's progress as its KV arrives, for the client's progress lines (pure).

The prefill engine sends each layer's rows of a prefill step as it computes them, so after the
chunk of layer L (of N) for rows [a, b), the decoder holds the prompt up to about a + (b - a) x
(L + 1) / N. That is reported, as the MLX engine reports its own chunked prefill, in steps of
REPORT_SHARE of the prompt, never for the last step (the first token follows at once).
"""

from __future__ import annotations

from dataclasses import dataclass

REPORT_SHARE = 0.05


@dataclass
class HandoffProgress:
    prompt_tokens: int
    layers: int  # the decoder's model's (0: unknown, a chunk counts as its rows all arrived)
    reported: int = 0

    def arrived(self, token_start: int, token_end: int, chunk_layers: tuple[int, ...]) -> int | None:
        """Prompt tokens to report as prefilled after this chunk, or None when not worth a line."""
        if not chunk_layers or token_end <= token_start:
            return None
        share = min((max(chunk_layers) + 1) / self.layers, 1.0) if self.layers > 0 else 1.0
        done = token_start + int((token_end - token_start) * share)
        step = max(int(self.prompt_tokens * REPORT_SHARE), 1)
        if done - self.reported < step or done >= self.prompt_tokens - 1:
            return None
        self.reported = done
        return done
