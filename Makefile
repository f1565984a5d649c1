# The two commands of the README: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test bench fuzz clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: this machine has its CPU wheel; an unpinned torch pulls a multi-GB CUDA build
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test,plot,traces,ray,chakra]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/fxworkload extract gpt2 --format tables,simai,chrome-trace --out outputs/gpt2

test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist worksteal

# The property-based CLI fuzzer with a large budget (make test runs a small derandomized one).
fuzz: $(STAMP)
	FXWORKLOAD_FUZZ_EXAMPLES=3000 $(BIN)/python -m pytest -q -s -p no:cacheprovider tests/test_fuzz.py

bench: $(STAMP)
	$(BIN)/python bench/extract.py
	$(BIN)/python bench/accuracy.py
	$(BIN)/python bench/coverage.py

clean:
	rm -rf $(VENV) outputs/*/
