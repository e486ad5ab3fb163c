# Two commands on a fresh machine:  `make demo` (the main job)  and  `make test` (the test suite);
# `make lint` runs ruff (pyproject.toml's [tool.ruff]).
# Each creates or updates the virtualenv in $(VENV) and is safe to re-run.
VENV  ?= .venv
PY    := $(VENV)/bin/python
TORCH ?= torch==2.13.0
# Triton as on our H200 machine; its interpreter runs the CPU tests.
TRITON ?= triton==3.6.0
STAMP := $(VENV)/.codagen-installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH)" "$(TRITON)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[test,bench,lint]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m codagen demo

test: $(STAMP)
	$(PY) -m pytest -q -ra

lint: $(STAMP)
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) demo_out
