# llmc developer entry points. `make demo` and `make test` work on a fresh clone.
PY := .venv/bin/python
PIP := $(PY) -m pip
LLMC := .venv/bin/llmc
CACHE ?= $(or $(LLMC_CACHE),$(HOME)/.cache/llmc)

.PHONY: setup demo test lint clean

setup: .venv/.installed

# torch first, pinned, so nothing pulls a multi-GB CUDA build.
.venv/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	touch $@

demo: setup
	$(LLMC) compile smollm2-135m --target cpu -o out/smol.llmc --force
	$(LLMC) inspect out/smol.llmc
	$(LLMC) run out/smol.llmc --chat --prompt "What is the capital of France?" --max-tokens 32

test: setup
	$(PY) -m pytest -q -p no:cacheprovider --timeout=1200

lint: setup
	.venv/bin/ruff check llmc compiler passes codegen runtime tests

clean:
	rm -rf out build *.egg-info
