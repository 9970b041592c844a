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
	$(LLMC) cache build
	touch $@

demo: setup
	$(LLMC) compile smollm2-135m --target cpu -o out/smol.llmc --force
	$(LLMC) inspect out/smol.llmc
	$(LLMC) run out/smol.llmc --chat --prompt "What is the capital of France?" --max-tokens 32

test: setup
	$(PY) -m pytest -q -p no:cacheprovider --timeout=1200 --durations=40

# lint-imports reads the packages as installed (llmc/compiler, …): it runs on a tree of links laid out so.
IMPORT_TREE := build/import-tree

lint: setup
	.venv/bin/ruff check llmc compiler passes codegen runtime tests
	rm -rf $(IMPORT_TREE) && mkdir -p $(IMPORT_TREE)/llmc
	ln -s $(CURDIR)/llmc/* $(IMPORT_TREE)/llmc/
	for stage in compiler passes codegen runtime; do ln -s $(CURDIR)/$$stage $(IMPORT_TREE)/llmc/$$stage; done
	cd $(IMPORT_TREE) && PYTHONPATH=. $(CURDIR)/.venv/bin/lint-imports $(CURDIR)/pyproject.toml --no-cache

clean:
	rm -rf out build *.egg-info
