# GPU hosts: the same model repository and pins on the NGC Triton container
# of the same release as the native server (versions.env: TRITON_IMAGE, 2.51.0).
#   make docker-build && make docker-run
# TRITON_IMAGE has no default here on purpose: the Makefile passes the one
# from versions.env, so the tag lives in one place.
ARG TRITON_IMAGE
FROM ${TRITON_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /opt/classify_describe

# Same pins as the native build; pip expands ${VAR} from the sourced versions.env.
# On x86_64 PyPI's torch wheel is the CUDA build, which is what a GPU host wants,
# so versions.env's TORCH_INDEX_URL (the CPU-only wheels of `make build`) is not used here.
COPY versions.env requirements.txt ./
RUN set -a && . ./versions.env && set +a \
 && pip install --no-cache-dir -r requirements.txt \
 && pip download --no-cache-dir --no-deps --dest /tmp/downloads "timm==${TIMM_LABELS_VERSION}"

# The backends' and the front's Triton-free package, installed as `make build` installs it
# (its dependencies are requirements.txt's, above).
COPY backends/pyproject.toml backends/
COPY backends/classify_describe_server/ backends/classify_describe_server/
RUN pip install --no-cache-dir --no-deps ./backends && rm -rf backends
# Our Python-based backends (model.py, the Triton adapters) sit next to Triton's own
# python backend, where `backend: "<name>"` finds them.
COPY backends/image/ /opt/tritonserver/backends/image/
COPY backends/openai_describe/ /opt/tritonserver/backends/openai_describe/
COPY model_repository/ /models/
# What ships besides: the supervisor and the stub watchdog (serving/, standard
# library only); the classifier export and its GPU config run once at build time.
COPY serving/ serving/
# The OpenAI-compatible front the supervisor starts beside the server (port 8003).
COPY openai_front/ openai_front/
COPY scripts/export_classifier.py scripts/export_onnx.py scripts/make_gpu_config.py scripts/

# The TorchScript file, labels and the ONNX files (fp32; int8 calibrated on photos that
# scikit-image and matplotlib bundle, installed for that step) are built from the pinned
# pretrained weights; configs/gpu.pbtxt (for --model-config-name=gpu: model.onnx in
# Triton's onnxruntime backend with TensorRT) from the classifier's config.pbtxt.
RUN set -a && . ./versions.env && set +a \
 && python3 scripts/export_classifier.py \
      --timm-wheel "/tmp/downloads/timm-${TIMM_LABELS_VERSION}-py3-none-any.whl" \
      --model-dir /models/classifier \
 && pip install --no-cache-dir "scikit-image==${SCIKIT_IMAGE_VERSION}" "matplotlib==${MATPLOTLIB_VERSION}" \
 && python3 scripts/export_onnx.py --model-dir /models/classifier \
 && rm -rf /tmp/downloads \
 && python3 scripts/make_gpu_config.py /models/classifier/config.pbtxt

EXPOSE 8000 8001 8002 8003
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s \
  CMD ["curl", "-fsS", "--noproxy", "*", "http://127.0.0.1:8000/v2/health/ready"]

# LLM_BASE_URL, LLM_MODEL, LLM_API_KEY / LLM_API_KEY_FILE come from the
# environment at run time (docs/llm-endpoints.md); nothing secret is baked in.
# The supervisor runs tritonserver with the stub watchdog beside it (Triton
# 2.51 neither restarts a dead Python stub nor reports it; docs/reliability.md),
# forwards TERM, and restricts the control APIs (model load/unload, repository,
# shared memory, logging, trace) to callers with the admin key:
# TRITON_ADMIN_KEY_FILE or TRITON_ADMIN_KEY, else one it generates into
# /tmp/triton-admin-key (`docker exec <container> cat /tmp/triton-admin-key`).
# TRITON_INFERENCE_KEY_FILE or TRITON_INFERENCE_KEY (optional) closes inference on
# 8000/8001 too (header inference-key; the front sends it itself).
# It also starts the OpenAI-compatible front (openai_front/, port OPENAI_PORT=8003;
# OPENAI_FRONT_API_KEY or OPENAI_FRONT_API_KEY_FILE require a key, OPENAI_FRONT=0 turns it off).
# It is what `make run` runs too. All interfaces, on purpose: published ports
# and the pod network reach the container from outside.
CMD ["/opt/classify_describe/serving/supervise_tritonserver.sh", "tritonserver", "--model-repository=/models", "--model-control-mode=explicit", "--load-model=*", "--exit-timeout-secs=30", "--http-address=0.0.0.0", "--grpc-address=0.0.0.0", "--metrics-address=0.0.0.0"]
