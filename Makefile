# Both targets build .venv themselves: torch first (the CPU wheel on this disk when it is
# there, a normal build elsewhere), then ds_muon with its extras, so pip never pulls a
# CUDA torch as a dependency of something else.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test venv clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps "litgpt==0.5.*"  # its pins would downgrade numpy; the census reads its model code only
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	DS_ACCELERATOR=cpu $(PY) -m pytest -q --durations=30 tests

clean:
	rm -rf $(VENV) build *.egg-info
