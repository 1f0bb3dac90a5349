"""Hub sources: fleet_downloader.hub.download_repo and stage_model against a fake hub on 127.0.0.1.

Every test points HF_ENDPOINT at the fake hub (download_repo reads it at each call and passes it to
huggingface_hub as endpoint=, since huggingface_hub itself reads HF_ENDPOINT only at import).
"""

from __future__ import annotations

import json
import random
import threading
import uuid
from pathlib import Path

import pytest
from huggingface_hub.constants import DOWNLOAD_CHUNK_SIZE

from fleet_downloader.hub import MARKER_NAME, download_repo, hub_folder, select_files
from fleet_downloader.sources import HubSource, SourceError, parse_source
from fleet_downloader.staging import local_model_folder, stage_model
from fleet_proto import DownloadPhase
from fleet_store import MODELS_BUCKET, file_key, load_manifest

from .fake_hub import FakeHub, fake_hub_fixture  # noqa: F401  (the fake_hub fixture)

WEIGHTS_SIZE = 3 * 1024 * 1024 + 17


def repo_files(seed: int = 0) -> dict[str, bytes]:
    """A repo as the hub holds it: what Fleet stages, plus original/, metal/ and other formats."""
    rng = random.Random(seed)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "seed": seed}
    return {
        "config.json": json.dumps(config).encode(),
        "generation_config.json": b'{"eos_token_id": 2}',
        "model.safetensors": rng.randbytes(WEIGHTS_SIZE),
        "tokenizer.json": json.dumps({"model": {"type": "BPE", "vocab": {"a": 0}}}).encode(),
        "tokenizer_config.json": b'{"eos_token": "</s>"}',
        "special_tokens_map.json": b'{"eos_token": "</s>"}',
        "chat_template.jinja": b"{% for m in messages %}{{ m.content }}{% endfor %}",
        "merges.txt": b"#version: 0.2\na b\n",
        "tokenizer.model": rng.randbytes(1000),
        # Skipped: the original checkpoint, Metal weights, other formats, repo metadata.
        "original/consolidated.00.pth": rng.randbytes(5000),
        "original/params.json": b'{"dim": 64}',
        "metal/x.bin": rng.randbytes(3000),
        "metal/config.json": b"{}",
        "pytorch_model.bin": rng.randbytes(4000),
        "pytorch_model.bin.index.json": b'{"weight_map": {}}',
        "model.gguf": b"GGUF" + rng.randbytes(100),
        "flax_model.msgpack": rng.randbytes(100),
        "README.md": b"# tiny\n",
        ".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
    }


STAGED = {
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "merges.txt",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
}


def unique_repo() -> str:
    return f"test-org/tiny-{uuid.uuid4().hex[:8]}"


def files_under(folder: Path) -> set[str]:
    return {
        path.relative_to(folder).as_posix()
        for path in folder.rglob("*")
        if path.is_file() and not any(part.startswith(".") for part in path.relative_to(folder).parts)
    }


class Reports:
    """A progress callback that records (phase, done, total), from any thread."""

    def __init__(self) -> None:
        self.items: list[tuple[DownloadPhase, int, int]] = []
        self._lock = threading.Lock()

    def __call__(self, phase: DownloadPhase, done: int, total: int) -> None:
        with self._lock:
            self.items.append((phase, done, total))


@pytest.fixture(autouse=True)
def hub_env(fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    monkeypatch.setenv("HF_ENDPOINT", fake_hub.url)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for name in ("HF_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    return fake_hub


def test_selection_follows_the_seed_rules():
    assert set(select_files(list(repo_files()))) == STAGED
    # *.json anywhere, except under original/ and metal/; weights only as safetensors.
    assert select_files(
        ["sub/config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json"]
    ) == [
        "sub/config.json",
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    assert (
        select_files(["original/model.safetensors", "metal/model.safetensors", "x.pth", "x.pt", "x.h5"]) == []
    )


def test_hub_folder_is_per_repo_and_revision(tmp_path):
    assert hub_folder(HubSource("org/name", ""), tmp_path) == tmp_path / "hub" / "org" / "name" / "main"
    assert hub_folder(HubSource("org/name", "refs/pr/1"), tmp_path) == (
        tmp_path / "hub" / "org" / "name" / "refs%2Fpr%2F1"
    )


def test_download_fetches_the_selected_files_only_and_a_second_call_fetches_nothing(fake_hub, tmp_path):
    repo = unique_repo()
    files = repo_files()
    commit = fake_hub.add_repo(repo, files)
    dest = tmp_path / "dest"
    reports = Reports()

    assert download_repo(HubSource(repo), dest, reports) == dest

    assert files_under(dest) == STAGED
    for name in STAGED:
        assert (dest / name).read_bytes() == files[name], name
    total = sum(len(files[name]) for name in STAGED)
    assert reports.items[-1] == (DownloadPhase.DOWNLOADING, total, total)
    assert {phase for phase, _, _ in reports.items} == {DownloadPhase.DOWNLOADING}
    assert all(0 <= done <= t == total for _, done, t in reports.items)
    fetched = {
        seen.path.removeprefix(f"{repo}/resolve/{commit}/") for seen in fake_hub.seen("GET", "/resolve/")
    }
    assert fetched == STAGED, "skipped files must not even be requested"
    assert all(seen.authorization is None for seen in fake_hub.seen())

    before = len(fake_hub.requests)
    again = Reports()
    assert download_repo(HubSource(repo), dest, again) == dest
    later = fake_hub.requests[before:]
    assert [seen.path for seen in later] == [f"api/models/{repo}"], "only the repo info is asked again"
    assert again.items[-1] == (DownloadPhase.DOWNLOADING, total, total)


def test_revision_forms_pick_their_commit(fake_hub, tmp_path):
    repo = unique_repo()
    main_commit = fake_hub.add_repo(repo, repo_files(seed=1))
    v2 = repo_files(seed=2)
    v2_commit = fake_hub.add_repo(repo, v2, "v2")
    assert main_commit != v2_commit

    source = parse_source(f"{repo}@v2")
    assert isinstance(source, HubSource)
    folder = local_model_folder(f"{repo}@v2", tmp_path / "work")
    assert folder == tmp_path / "work" / "hub" / repo / "v2"
    assert (folder / "model.safetensors").read_bytes() == v2["model.safetensors"]
    assert fake_hub.seen("GET", f"api/models/{repo}/revision/v2")

    by_commit = download_repo(HubSource(repo, v2_commit), tmp_path / "by-commit")
    assert (by_commit / "config.json").read_bytes() == v2["config.json"]


def test_a_moved_branch_replaces_the_files_and_drops_stale_ones(fake_hub, tmp_path):
    repo = unique_repo()
    first = repo_files(seed=1)
    fake_hub.add_repo(repo, first)
    dest = tmp_path / "dest"
    download_repo(HubSource(repo), dest)
    second = {name: data for name, data in repo_files(seed=2).items() if name != "merges.txt"}
    second_commit = fake_hub.add_repo(repo, second)

    download_repo(HubSource(repo), dest)

    assert files_under(dest) == STAGED - {"merges.txt"}
    assert (dest / "config.json").read_bytes() == second["config.json"]
    assert json.loads((dest / MARKER_NAME).read_text())["commit"] == second_commit


def test_unknown_repo_names_the_repo_and_the_hub_answer(fake_hub, tmp_path):
    with pytest.raises(SourceError) as caught:
        download_repo(HubSource("nobody/nothing"), tmp_path / "dest")
    message = str(caught.value)
    assert "nobody/nothing" in message and "repository not found" in message
    assert "HTTP 404" in message and fake_hub.url in message
    assert not fake_hub.seen("GET", "/resolve/")


def test_unknown_revision_is_a_clear_error(fake_hub, tmp_path):
    repo = unique_repo()
    fake_hub.add_repo(repo, repo_files())
    with pytest.raises(SourceError, match=rf"{repo}@nope: revision 'nope' not found .*HTTP 404"):
        download_repo(HubSource(repo, "nope"), tmp_path / "dest")


def test_gated_repo_needs_the_right_token(fake_hub, tmp_path, monkeypatch):
    repo = unique_repo()
    fake_hub.add_repo(repo, repo_files(), token="hf_secret")

    with pytest.raises(
        SourceError, match=rf"{repo}: gated repo .*no HF_TOKEN is set \(HTTP 401 Unauthorized"
    ):
        download_repo(HubSource(repo), tmp_path / "dest")
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(SourceError, match=r"gated repo .*HF_TOKEN was refused \(HTTP 403 Forbidden"):
        download_repo(HubSource(repo), tmp_path / "dest")
    assert not fake_hub.seen("GET", "/resolve/")

    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    dest = download_repo(HubSource(repo), tmp_path / "dest")
    assert files_under(dest) == STAGED
    assert all(seen.authorization == "Bearer hf_secret" for seen in fake_hub.seen("GET", "/resolve/"))


def test_offline_without_a_complete_copy_is_a_clear_error_and_sends_nothing(fake_hub, tmp_path, monkeypatch):
    repo = unique_repo()
    fake_hub.add_repo(repo, repo_files())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        SourceError, match=rf"{repo}: HF_HUB_OFFLINE is set \(offline mode\) and the repo was never"
    ):
        download_repo(HubSource(repo), tmp_path / "dest")
    assert fake_hub.requests == []


def test_offline_uses_a_complete_copy(fake_hub, tmp_path, monkeypatch):
    repo = unique_repo()
    fake_hub.add_repo(repo, repo_files())
    dest = download_repo(HubSource(repo), tmp_path / "dest")
    before = len(fake_hub.requests)

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    reports = Reports()
    assert download_repo(HubSource(repo), dest, reports) == dest
    assert len(fake_hub.requests) == before
    total = sum((dest / name).stat().st_size for name in STAGED)
    assert reports.items == [(DownloadPhase.DOWNLOADING, total, total)]

    (dest / "tokenizer.json").unlink()
    with pytest.raises(SourceError, match=r"offline mode\) and 1 downloaded file\(s\) are missing"):
        download_repo(HubSource(repo), dest)


def test_a_repo_without_safetensors_is_refused_before_downloading(fake_hub, tmp_path):
    repo = unique_repo()
    files = {name: data for name, data in repo_files().items() if name != "model.safetensors"}
    fake_hub.add_repo(repo, files)
    with pytest.raises(
        SourceError, match=r"no \*\.safetensors weights \(it has \.bin, \.gguf, \.pth files\)"
    ):
        download_repo(HubSource(repo), tmp_path / "dest")
    assert not fake_hub.seen("GET", "/resolve/")


def test_a_dropped_connection_resumes_with_a_range_request(fake_hub, tmp_path):
    # huggingface_hub writes what it receives in DOWNLOAD_CHUNK_SIZE (10 MiB) pieces and resumes from
    # the last whole piece: the weights need more than one piece for a Range request to happen.
    repo = unique_repo()
    files = repo_files()
    files["model.safetensors"] = random.Random(3).randbytes(DOWNLOAD_CHUNK_SIZE + 2 * 1024 * 1024)
    fake_hub.add_repo(repo, files)
    fake_hub.drop_connection_once(repo, "model.safetensors", after_bytes=DOWNLOAD_CHUNK_SIZE + 1024 * 1024)

    dest = download_repo(HubSource(repo), tmp_path / "dest")

    assert (dest / "model.safetensors").read_bytes() == files["model.safetensors"]
    ranges = [seen.range for seen in fake_hub.seen("GET", "/model.safetensors")]
    assert ranges == [None, f"bytes={DOWNLOAD_CHUNK_SIZE}-"]


class Stop(Exception):
    pass


def test_a_raising_progress_callback_stops_the_download_and_a_rerun_keeps_finished_files(fake_hub, tmp_path):
    repo = unique_repo()
    files = repo_files()
    files["model.safetensors"] = random.Random(4).randbytes(DOWNLOAD_CHUNK_SIZE + 2 * 1024 * 1024)
    fake_hub.add_repo(repo, files)
    # The weights stall after their first 10 MiB piece until the callback raises.
    fake_hub.hold("model.safetensors", after_bytes=DOWNLOAD_CHUNK_SIZE + 1024 * 1024)
    dest = tmp_path / "dest"
    calls = 0

    def stop_on_second_report(phase: DownloadPhase, done: int, total: int) -> None:
        nonlocal calls
        calls += 1
        if calls >= 2:  # the first report comes before the download; the second from the poller
            fake_hub.release("model.safetensors")
            raise Stop

    with pytest.raises(Stop):
        download_repo(HubSource(repo), dest, stop_on_second_report)
    assert not (dest / "model.safetensors").exists(), "the weights were finished despite the stop"
    assert not list((dest / ".cache").rglob("*.incomplete")), "the partial file is left behind"
    assert not (dest / MARKER_NAME).exists()
    kept = files_under(dest)

    before = len(fake_hub.requests)
    download_repo(HubSource(repo), dest)
    refetched = {
        seen.path.rpartition("/")[2] for seen in fake_hub.requests[before:] if "/resolve/" in seen.path
    }
    assert "model.safetensors" in refetched
    assert not refetched & kept, "files finished before the interruption are downloaded again"
    assert files_under(dest) == STAGED
    assert (dest / "model.safetensors").read_bytes() == files["model.safetensors"]


def test_stage_model_stages_a_hub_repo_with_exactly_the_selected_files(fake_hub, store, tmp_path):
    repo = unique_repo()
    files = repo_files()
    fake_hub.add_repo(repo, files)
    model_id = f"staged/{repo.split('/')[1]}"
    reports = Reports()

    manifest = stage_model(store, model_id, repo, work_dir=tmp_path / "work", progress=reports)

    assert sorted(file.path for file in manifest.files) == sorted(STAGED)
    assert manifest.source == repo and manifest.revision == "main"
    assert manifest.config == json.loads(files["config.json"])
    assert load_manifest(store, MODELS_BUCKET, model_id, "main") == manifest
    for file in manifest.files:
        assert store.get_bytes(MODELS_BUCKET, file_key(model_id, "main", file.path)) == files[file.path]
    phases = [phase for phase, _, _ in reports.items]
    assert phases[0] == DownloadPhase.DOWNLOADING and phases[-1] == DownloadPhase.UPLOADING
    assert phases.index(DownloadPhase.UPLOADING) > max(
        i for i, phase in enumerate(phases) if phase == DownloadPhase.DOWNLOADING
    )
    assert (tmp_path / "work" / "hub" / repo / "main" / "config.json").is_file()
