PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test bench lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,bench]'
	touch $(STAMP)

run: install
	$(BIN)/python -m loadtest.demo

test: install
	$(BIN)/python -m pytest -q tests

bench: install
	$(BIN)/python -m loadtest.bench

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
