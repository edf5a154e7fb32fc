# Triton model package: image classification + LLM description.
#   make build   venv, Triton server, backend directory, model artifacts
#   make run     serve model_repository/ natively on 127.0.0.1 (HTTP 8000, gRPC 8001, metrics 8002, OpenAI 8003)
#   make demo    start the server, classify and describe docs/sample/coffee.png, stop it
#   make test    build, then unit + integration tests against a real server
# Every version comes from versions.env.

include versions.env
export

SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON_BIN ?= python3
VENV       := .venv
PY         := $(VENV)/bin/python
BUILD      := build
TRITON_DIR := $(BUILD)/triton
TRITON_HOME := $(TRITON_DIR)/pytriton/tritonserver
BACKEND_DIR := $(BUILD)/backends
DOWNLOADS  := $(BUILD)/downloads
TIMM_WHEEL := $(DOWNLOADS)/timm-$(TIMM_LABELS_VERSION)-py3-none-any.whl
CLASSIFIER := model_repository/classifier
CLASSIFIER_FILE := $(CLASSIFIER)/1/model.pt
LABELS_FILE := $(CLASSIFIER)/labels.txt
ONNX_FILES := $(CLASSIFIER)/1/model.onnx $(CLASSIFIER)/1/model.int8.onnx
GPU_CONFIG := $(CLASSIFIER)/configs/gpu.pbtxt
OUR_BACKENDS := $(notdir $(patsubst %/model.py,%,$(wildcard backends/*/model.py)))
PERF_DIR   := $(BUILD)/perf_analyzer
LITELLM_DIR := $(BUILD)/litellm-venv
LLAMACPP_DIR := $(BUILD)/llamacpp-venv
BENTOML_DIR := $(BUILD)/bentoml-venv

HTTP_PORT    ?= 8000
GRPC_PORT    ?= 8001
METRICS_PORT ?= 8002
OPENAI_PORT  ?= 8003
IMAGE_NAME   ?= triton-classify-describe:latest

# Stamps make `make build` quick when nothing changed.
VENV_STAMP    := $(VENV)/.installed
TRITON_STAMP  := $(TRITON_DIR)/.installed
BACKEND_STAMP := $(BACKEND_DIR)/.linked
SERVER_PACKAGE_STAMP := $(VENV)/.server-package

.PHONY: help build run test unit integration lint docker-build docker-run clean perf-analyzer

help:
	@echo "make build          venv + Triton $(TRITON_VERSION) + backends + model artifacts"
	@echo "make run            start tritonserver on model_repository/ (HTTP_PORT=$(HTTP_PORT) GRPC_PORT=$(GRPC_PORT) METRICS_PORT=$(METRICS_PORT))"
	@echo "                    and the OpenAI-compatible front beside it (OPENAI_PORT=$(OPENAI_PORT))"
	@echo "                    on 127.0.0.1; LISTEN_ADDRESS=0.0.0.0 exposes it. Load/unload, shared memory, logging"
	@echo "                    and trace need header admin-key: TRITON_ADMIN_KEY(_FILE), else generated into build/admin-key-<HTTP_PORT>"
	@echo "make demo           start the server, send docs/sample/coffee.png through classify_and_describe, stop it"
	@echo "make test           build, then unit and integration tests (real server, fake LLM upstream)"
	@echo "make test-upstreams every path against the fake, LiteLLM and llama-cpp-python's server (SmolLM2-135M, keyless; its build ~6 min once)"
	@echo "make bench          perf_analyzer benchmarks -> docs/results/bench.json, and from it docs/benchmarks.md + docs/plots (~20 min)"
	@echo "make bench-quick    the targets in about 5 minutes (build/bench/quick)"
	@echo "make bentoml-baseline  BentoML $(BENTOML_VERSION) in build/bentoml-venv: the same job served by BentoML, for make bench"
	@echo "make bench-openai   the OpenAI front's added latency and throughput vs direct gRPC (~3 min)"
	@echo "make bench-cpu      CPU per request by process and step vs in-process (~4 min; BENCH_CPU_ARGS=--compare K=V for an A/B)"
	@echo "make bench-scaling  throughput and memory per instance on 1 and 2 cores (taskset) vs in-process (~4 min)"
	@echo "make bench-idle     why a saturated server leaves cores idle: /proc/stat and a perf sched trace (~5 min)"
	@echo "make bench-lone     a lone request's time by step, from Triton's trace at concurrency 1 (~1 min)"
	@echo "make bench-stream   streaming benchmarks -> docs/benchmarks-streaming.md (~3 min)"
	@echo "make soak           10-minute soak with faults and hostile input (SOAK_ARGS=...)"
	@echo "make rehearse       two replicas behind nginx, one restarted under load"
	@echo "make overload       goodput per client kind at 20x the saturating load; nothing lost"
	@echo "make mutants        mutation testing of the pure modules with the unit tests -> docs/mutation.md (long)"
	@echo "make int8-cpus      the int8 graph under emulated AVX2-only CPUs (no VNNI) vs this one (~10 min; installs qemu-user)"
	@echo "make docker-build   image FROM $(TRITON_IMAGE) for GPU hosts"
	@echo "make docker-run     run that image with --gpus all"

build: $(VENV_STAMP) $(SERVER_PACKAGE_STAMP) $(TRITON_STAMP) $(BACKEND_STAMP) $(CLASSIFIER_FILE) $(LABELS_FILE) $(ONNX_FILES) $(GPU_CONFIG)

# torch first, from TORCH_INDEX_URL (versions.env: PyTorch's CPU-only wheels)
# besides pip's usual indexes: torch==X matches X+cpu there, which pip ranks
# above PyPI's CUDA build. --no-deps keeps every other package, torch's own
# dependencies included, on the usual indexes (the next line installs them):
# where that index cannot be reached (machines with local indexes only), each
# package looked up there costs pip's five retries, about 8 s.
$(VENV_STAMP): requirements.txt requirements-dev.txt versions.env scripts/check_python.sh pyproject.toml
	scripts/check_python.sh $(PYTHON_BIN)
	test -x $(PY) || $(PYTHON_BIN) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(if $(TORCH_INDEX_URL),$(PY) -m pip install --quiet --no-deps --extra-index-url $(TORCH_INDEX_URL) torch==$(TORCH_VERSION))
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@

# The backends' and the front's Triton-free package (backends/classify_describe_server),
# editable: a change to it needs no reinstall. Its dependencies are requirements.txt's pins.
$(SERVER_PACKAGE_STAMP): backends/pyproject.toml | $(VENV_STAMP)
	$(PY) -m pip install --quiet --no-deps --editable ./backends
	touch $@

# The server binary, its Python backend and stubs come from the nvidia-pytriton
# wheel; --no-deps because we never import pytriton (its numpy<2 pin and client
# pins are not ours).
$(TRITON_STAMP): versions.env | $(VENV_STAMP)
	rm -rf $(TRITON_DIR)
	$(PY) -m pip install --quiet --no-deps --target $(TRITON_DIR) nvidia-pytriton==$(PYTRITON_VERSION)
	touch $@

$(BACKEND_STAMP): $(TRITON_STAMP) scripts/make_backend_dir.sh $(wildcard backends/*/model.py)
	scripts/make_backend_dir.sh $(TRITON_HOME) $(BACKEND_DIR) $(PY) $(OUR_BACKENDS)
	touch $@

$(TIMM_WHEEL): | $(VENV_STAMP)
	$(PY) -m pip download --quiet --no-deps --dest $(DOWNLOADS) timm==$(TIMM_LABELS_VERSION)

$(CLASSIFIER_FILE) $(LABELS_FILE) &: scripts/export_classifier.py $(TIMM_WHEEL) | $(VENV_STAMP)
	$(PY) scripts/export_classifier.py --timm-wheel $(TIMM_WHEEL) --model-dir $(CLASSIFIER)

# ONNX fp32 and int8 (calibrated on photos that scikit-image and matplotlib bundle) from the same weights.
$(ONNX_FILES) &: scripts/export_onnx.py $(CLASSIFIER_FILE) $(LABELS_FILE) | $(VENV_STAMP)
	$(PY) scripts/export_onnx.py --model-dir $(CLASSIFIER)

# The classifier's config for --model-config-name=gpu, generated from its CPU config.
$(GPU_CONFIG): scripts/make_gpu_config.py $(CLASSIFIER)/config.pbtxt | $(VENV_STAMP)
	$(PY) scripts/make_gpu_config.py $(CLASSIFIER)/config.pbtxt $@

run: build
	HTTP_PORT=$(HTTP_PORT) GRPC_PORT=$(GRPC_PORT) METRICS_PORT=$(METRICS_PORT) OPENAI_PORT=$(OPENAI_PORT) LISTEN_ADDRESS=$(LISTEN_ADDRESS) scripts/serve.sh

# A first answer: scripts/serve.sh on 127.0.0.1, one request with the sample
# photo through the repository's client, then the server stopped by its PID.
.PHONY: demo
demo: build
	HTTP_PORT=$(HTTP_PORT) GRPC_PORT=$(GRPC_PORT) METRICS_PORT=$(METRICS_PORT) scripts/demo.sh

test: build perf-analyzer litellm-gateway
	scripts/run_tests.sh

unit: build
	$(PY) -m pytest -q tests/unit

integration: build
	$(PY) -m pytest -q tests/integration

lint: $(VENV_STAMP)
	$(VENV)/bin/hadolint Dockerfile
	$(VENV)/bin/ruff check .

# perf_analyzer ships only in the tritonclient==2.41.1 manylinux wheel; it
# lives apart from the runtime venv (its tritonclient is older than ours).
perf-analyzer: $(PERF_DIR)/.installed
$(PERF_DIR)/.installed: versions.env scripts/install_perf_analyzer.sh | $(TRITON_STAMP)
	scripts/install_perf_analyzer.sh $(PY) $(PERF_DIR) $(TRITON_DIR)/nvidia_pytriton.libs
	touch $@

# The LiteLLM proxy (the shared LLM gateway, docs/llm-gateway.md) for
# tests/integration/test_llm_gateway.py, in its own venv (about 800 MB, 2 min).
.PHONY: litellm-gateway
litellm-gateway: $(LITELLM_DIR)/.installed
$(LITELLM_DIR)/.installed: versions.env requirements-litellm.txt scripts/install_litellm.sh scripts/make_side_venv.sh
	scripts/install_litellm.sh $(PYTHON_BIN) $(LITELLM_DIR)
	touch $@

# llama-cpp-python's OpenAI-compatible server and SmolLM2-135M, a real LLM server nobody here
# wrote, for tests/upstreams (built from source once, about 6 minutes on 2 cores).
.PHONY: llamacpp-server test-upstreams
llamacpp-server: $(LLAMACPP_DIR)/.installed
$(LLAMACPP_DIR)/.installed: versions.env requirements-llamacpp.txt scripts/install_llamacpp.sh scripts/make_side_venv.sh
	scripts/install_llamacpp.sh $(PYTHON_BIN) $(LLAMACPP_DIR)
	touch $@

# Every path (whole, streams over gRPC and the front, vision auto, a wrong key, a server that
# goes away) against the fake and that server, keyless as a local user starts it (~1 min after the build).
test-upstreams: build llamacpp-server litellm-gateway
	$(PY) -m pytest -q tests/upstreams

# BentoML serving the same job (tools/bench/bentoml_service.py), the baseline
# `make bench` measures the ensemble against, in its own venv (about 330 MB,
# 1 min); not part of `make test`.
.PHONY: bentoml-baseline
bentoml-baseline: $(BENTOML_DIR)/.installed
$(BENTOML_DIR)/.installed: versions.env requirements-bentoml.txt scripts/install_bentoml.sh scripts/make_side_venv.sh
	scripts/install_bentoml.sh $(PYTHON_BIN) $(BENTOML_DIR)
	touch $@

docker-build:
	docker build --build-arg TRITON_IMAGE=$(TRITON_IMAGE) -t $(IMAGE_NAME) .

# Every LLM_*, OPENAI_FRONT_*, TRITON_TRACE_* and CPU_* variable that is set goes in by name only
# (-e NAME: docker reads the value), so no key shows in make's output or in argv; not
# the *_FILE ones, paths on this host that the container cannot read.
DOCKER_ENV = $(sort $(foreach v,$(filter LLM_% OPENAI_FRONT_% TRITON_TRACE_% CPU_%,$(.VARIABLES)),\
  $(if $(filter environment% command%,$(origin $v)),$(if $(filter %_FILE,$v),,$v))) \
  TRITON_ADMIN_KEY TRITON_INFERENCE_KEY)

docker-run:
	docker run --rm --gpus all --shm-size=1g \
	  -p $(HTTP_PORT):8000 -p $(GRPC_PORT):8001 -p $(METRICS_PORT):8002 -p $(OPENAI_PORT):8003 \
	  $(addprefix -e ,$(DOCKER_ENV)) $(IMAGE_NAME)

clean:
	rm -rf $(BUILD) $(CLASSIFIER_FILE) $(LABELS_FILE) $(ONNX_FILES) $(GPU_CONFIG)

# Scaling rehearsal (docs/scaling.md): two native replicas behind nginx on
# loopback, one stopped with SIGTERM and restarted under load; stops by itself
# and fails unless every request was answered. Longer: REHEARSE_ARGS="--failover-s 300".
.PHONY: rehearse
rehearse: build
	$(PY) -m tools.rehearse_scaling $(REHEARSE_ARGS)

# Benchmarks: perf_analyzer against a server and a fake LLM upstream that the run
# starts on free ports (tools/bench/), and the same job served by BentoML
# (bentoml-baseline). Not part of `make test`. The report is
# generated from the run's results file alone (python -m tools.bench.report FILE).
#   make bench         docs/results/bench.json, docs/benchmarks.md, docs/plots/*.png (about 20 minutes)
#   make bench-quick   the targets in about 5 minutes (build/bench/quick/; the BentoML section about 1.5 of them)
.PHONY: bench bench-quick
bench: build perf-analyzer bentoml-baseline
	$(PY) -m tools.bench.run --mode full

bench-quick: build perf-analyzer bentoml-baseline
	$(PY) -m tools.bench.run --mode quick --results $(BUILD)/bench/quick/results.json

# The OpenAI-compatible front against tritonclient gRPC directly, side by side in
# one run (fake LLM 0 ms): added p50 latency and throughput at the saturating
# concurrency -> docs/results/openai-front-<UTC time>.json and its section of
# docs/benchmarks.md (about 3 minutes).
.PHONY: bench-openai
bench-openai: build
	$(PY) -m tools.bench.openai_front $(BENCH_OPENAI_ARGS)

# Where the CPU goes (docs/benchmarks-method.md#where-the-cpu-goes): CPU ms per request by process
# (/proc) and by step (perf, where installed) for classify and the ensemble, against the in-process
# decode + forward; BENCH_CPU_ARGS="--compare CPU_CORES=3" measures a server setting side by side.
.PHONY: bench-cpu
bench-cpu: build perf-analyzer
	$(PY) -m tools.bench.cpu_profile --rounds 3 --seconds 10 --concurrency 8 --results $(BUILD)/bench/cpu/results.json $(BENCH_CPU_ARGS)

# Throughput and memory as the cores grow (tools/bench/scaling.py): classify and the ensemble served
# on the first N cores (taskset; the server sizes its layout for them) beside the in-process limit on
# the same cores, and PSS per instance; about 2 minutes per core count.
#   make bench-scaling BENCH_SCALING_ARGS="--cores 1,2,4,8,16"   (on a host with 16 cores)
.PHONY: bench-scaling
bench-scaling: build perf-analyzer
	$(PY) -m tools.bench.scaling --results $(BUILD)/bench/scaling.json $(BENCH_SCALING_ARGS)

# Why a saturated server leaves cores idle (tools/bench/idle_cores.py): /proc/stat's idle share under
# perf_analyzer beside the in-process loop's, and a perf sched trace of what waited on another core
# while one sat idle; about 5 minutes.   make bench-idle BENCH_IDLE_ARGS="--env CPU_CORES=1"
.PHONY: bench-idle
bench-idle: build perf-analyzer
	$(PY) -m tools.bench.idle_cores --results $(BUILD)/bench/idle-cores.json $(BENCH_IDLE_ARGS)

# A lone request's time by step (tools/bench/lone_request.py): Triton's trace of every request at
# concurrency 1, the ensemble's steps one after the other; about 1 minute.
#   make bench-lone BENCH_LONE_ARGS="--model classify"
.PHONY: bench-lone
bench-lone: build perf-analyzer
	$(PY) -m tools.bench.lone_request --results $(BUILD)/bench/lone-request.json $(BENCH_LONE_ARGS)

# Streaming (tools/bench/streaming.py): time to labels vs classify, time to first token vs the
# SDK direct, 500 concurrent streams, perf_analyzer --streaming; about 3 minutes.
#   make bench-stream   docs/results/streaming.json + docs/benchmarks-streaming.md
.PHONY: bench-stream
bench-stream: build perf-analyzer
	$(PY) -m tools.bench.streaming --mode full

# Soak and faults (docs/reliability.md): fake LLM upstream + one server on loopback
# free ports, valid load at the concurrency that saturates the ensemble (HTTP,
# gRPC streams and the OpenAI front, whole and streamed), the
# hostile corpus, LLM faults, a version swap, a stub SIGKILL, a restart with
# retrying clients; stops by itself; fails if a request was lost or a secret leaked.
#   make soak                         10 minutes
#   make soak SOAK_ARGS="--duration-s 180"
.PHONY: soak
soak: build
	$(PY) -m tools.soak $(SOAK_ARGS)

# Overload (docs/reliability.md#overload): fake LLM (1 s) + one server with its
# OpenAI front + the shedding proxy of deploy/nginx, on loopback free ports; a
# sweep finds the saturating number of users, then goodput (answered/s) per client
# kind at 20x as many: C users resending at once (bare, through the proxy), C
# users backing off, classify_describe (gRPC, HTTP through the proxy), the openai
# SDK through the front, C users backing off through the front without and with
# Expect: 100-continue. Each phase runs a 60 s warm-up, then its measured 30 s
# (the steady state; docs/reliability.md#overload), each kind between two
# saturation phases measured again (its share is against their mean). About 27
# minutes; fails below the goodput targets or if anything is lost.
# --rounds N measures every kind N times and judges its median share.
#   make overload OVERLOAD_ARGS="--saturation 64 --factors 4,20 --phase-s 60"
#   make overload OVERLOAD_ARGS="--kinds openai-front --saturation 128 --warmup-s 30"
.PHONY: overload
overload: build
	$(PY) -m tools.overload --results $(BUILD)/overload/results.json $(OVERLOAD_ARGS)

# int8 on every x86-64 CPU (docs/classifier-runtime.md#int8): the build's graph run
# on evaluation crops here and under qemu's emulation of AVX2-only CPUs (Intel
# Haswell, AMD EPYC Rome: no VNNI, no AVX-512), the answers compared. Installs
# Debian's qemu-user if missing (needs root); about 10 minutes.
.PHONY: int8-cpus
int8-cpus: build
	command -v qemu-x86_64 >/dev/null || { apt-get update -qq && apt-get install -y -qq qemu-user; }
	$(PY) -m tools.int8_cross_cpu --results docs/results/int8-cross-cpu.json

# Mutation testing (docs/mutation.md): mutmut over the pure modules, each mutant
# running only the unit tests that reach the mutated function; not part of
# `make test`. Fails when a module scores under 85 % or a surviving mutant has
# no reason in tools/mutation/explained.py. Raw output: build/mutants/.
#   make mutants MUTANTS_ARGS="--module resilience --module accounting"
.PHONY: mutants
mutants: build
	$(PY) -m tools.mutation.run $(MUTANTS_ARGS)
