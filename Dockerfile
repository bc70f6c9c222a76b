# syntax=docker/dockerfile:1
# spork_trt's serving image, the one `python -m spork_trt export k8s` manifests name (spork-trt:0.1.0).
#   make image                                   builds it (docker build -t spork-trt:0.1.0 .)
#   docker run --rm -p 127.0.0.1:9000:9000 -e SPORK_API_KEY=... spork-trt:0.1.0
# Two stages: `build` installs the pinned environment (docker/install.sh), compiles spork's CPU kernels for both ISA
# baselines (avx2: x86-64-v3 with F16C; avx512-bf16: x86-64-v4 with AVX512-BF16 and AMX-BF16: named flags, never
# -march=native, so any x86-64 builder makes the same libraries; each process loads the one its CPU runs) and bakes
# the default build into /engines; the final stage holds that environment, the kernels and /engines, runs as a
# non-root user and has no compiler. Mount another build over /engines (and pass --repo) to serve your own model.
# Unverified: no Docker engine has built this image yet (docs/support.md); tests/test_image.py parses it and runs
# docker/install.sh.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
ENV TORCH_EXTENSIONS_DIR=/opt/spork/kernels
WORKDIR /src
COPY requirements.txt requirements-nodeps.txt pyproject.toml README.md LICENSE ./
COPY spork_trt spork_trt
COPY export export
COPY bench bench
COPY docker/install.sh docker/install.sh
RUN sh docker/install.sh /opt/spork/venv
RUN /opt/spork/venv/bin/python -m export build --out /engines

FROM ${PYTHON_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends haproxy libgomp1 && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 1000 --create-home --shell /usr/sbin/nologin spork
COPY --from=build /opt/spork /opt/spork
COPY --from=build --chown=1000:1000 /engines /engines
ENV PATH=/opt/spork/venv/bin:$PATH TORCH_EXTENSIONS_DIR=/opt/spork/kernels PYTHONUNBUFFERED=1
USER 1000
WORKDIR /home/spork
EXPOSE 8000 8001 8002 9000
CMD ["python", "-m", "spork_trt", "serve", "--host", "0.0.0.0", "--repo", "/engines/triton_repo"]
