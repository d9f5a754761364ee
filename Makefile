# kvferry: the two entry points are `make demo` and `make test`; each sets itself up.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test venv clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test,fast]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvferry demo

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) runs .pytest_cache

BUF := .tools/node_modules/.bin/buf

$(BUF):
	npm install --prefix .tools --no-audit --no-fund --silent @bufbuild/buf@1.75.0

.PHONY: proto proto-check
proto: $(STAMP)
	$(BIN)/python scripts/gen_proto.py

# buf lint, the breaking-change check against the released v1 image, and stub drift
proto-check: $(STAMP) $(BUF)
	cd proto && ../$(BUF) lint && ../$(BUF) breaking --against released/kvferry-v1.binpb
	$(BIN)/python scripts/gen_proto.py --check
