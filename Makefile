PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test lint stop clean

# Train a small GPT on the embedded stack through an injected rank crash; print the timeline.
demo: $(STAMP)
	$(VENV)/bin/stayalive demo

# The whole suite: lint, types, then every test (a real Temporal dev server, real torch ranks).
test: lint
	$(VENV)/bin/pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

stop: $(STAMP)
	$(VENV)/bin/stayalive dev down

clean:
	rm -rf $(VENV) .stayalive

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet --constraint constraints.txt -e ".[dev]"
	touch $@
