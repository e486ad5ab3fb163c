# Two commands on a fresh machine:  `make demo` (the main job)  and  `make test` (the test suite);
# `make lint` runs ruff (pyproject.toml's [tool.ruff]).
# Each creates or updates the virtualenv in $(VENV) and is safe to re-run.
VENV  ?= .venv
PY    := $(VENV)/bin/python
TORCH ?= torch==2.13.0
# Triton as on our H200 machine; its interpreter runs the CPU tests.
TRITON ?= triton==3.6.0
# torchtitan and what its model code imports, without its other requirements (its full install moves
# huggingface_hub to 1.x, which transformers < 5.25 refuses): the tests of codagen.integrations.torchtitan
TORCHTITAN_TEST ?= torchtitan==0.3.0 tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1 spmd_types==0.2.3 \
	torch_checkpointing==0.1.1
STAMP := $(VENV)/.codagen-installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH)" "$(TRITON)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[test,bench,lint]"
	$(PY) -m pip install -q --disable-pip-version-check --no-deps $(TORCHTITAN_TEST)
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m codagen demo

test: $(STAMP)
	$(PY) -m pytest -q -ra

lint: $(STAMP)
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) demo_out
