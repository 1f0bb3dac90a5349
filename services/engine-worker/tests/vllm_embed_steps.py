"""VllmEmbedder driven directly, to count its steps (an engine process does not show them): every
request is added before the first step, then the engine steps until idle.

Run as a script in its own process (the test process stays light):
`python vllm_embed_steps.py MODEL_DIR '{"request id": [[token ids], ...], ...}'` prints one JSON
object: {"steps": N, "vectors": {"request id": [[float, ...], ...]}}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from fleet_worker.engines.base import EngineRequest, load_engine


def main() -> None:
    model_dir, requests = Path(sys.argv[1]), json.loads(sys.argv[2])
    engine = load_engine("vllm", model_dir, embedding=True)
    for request_id, inputs in requests.items():
        embed_inputs = tuple(tuple(tokens) for tokens in inputs)
        engine.add(EngineRequest(request_id=request_id, prompt_token_ids=(), embed_inputs=embed_inputs))
    steps, vectors = 0, {}
    while engine.has_work():
        steps += 1
        for output in engine.step():
            assert output.finish_reason == "stop", output.error
            vectors[output.request_id] = [np.frombuffer(v, "<f4").tolist() for v in output.embeddings]
    engine.close()
    print(json.dumps({"steps": steps, "vectors": vectors}))


if __name__ == "__main__":
    main()
