PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test lint wheel-check stop clean

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

# The wheel as a user installs it: built from this tree into a fresh venv with the pinned torch;
# `stayalive` imports, and none of the repository's folders is importable at the top level.
WHEEL_DIR := .stayalive/wheel-check
wheel-check: $(STAMP)
	rm -rf $(WHEEL_DIR)
	$(VENV)/bin/pip wheel --quiet --no-deps --wheel-dir $(WHEEL_DIR) .
	$(PYTHON) -m venv $(WHEEL_DIR)/venv
	$(WHEEL_DIR)/venv/bin/pip install --quiet --constraint constraints.txt $(WHEEL_DIR)/stayalive-*.whl
	cd $(WHEEL_DIR) && venv/bin/python -c "import stayalive.training.run, stayalive.workflows.run; print('import stayalive: ok')"
	cd $(WHEEL_DIR) && for name in core training workflows workers agent activities sim bench; do \
		! venv/bin/python -c "import $$name" 2>/dev/null || { echo "import $$name works: the wheel shadows it"; exit 1; }; \
	done; echo "no top-level core, training, workflows, workers, agent, activities, sim, bench: ok"
	rm -rf $(WHEEL_DIR)

stop: $(STAMP)
	$(VENV)/bin/stayalive dev down

clean:
	rm -rf $(VENV) .stayalive

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet --constraint constraints.txt -e ".[dev]"
	touch $@
