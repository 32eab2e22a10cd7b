# Two commands matter: `make demo` and `make test` (see README).
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
OPTC := $(VENV)/bin/optc
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
export OPTC_CACHE ?= $(HOME)/.cache/optc
export PYTHONUNBUFFERED := 1

.PHONY: install demo test test-slow bench clean

install: $(VENV)/.installed

# torch is pinned in requirements.txt (a CPU build); pyproject keeps loose ranges.
$(VENV)/.installed: pyproject.toml requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) -r requirements.txt
	$(PIP) -e '.[test]'
	touch $@

demo: install
	$(OPTC) run w4a16-rtn --output out/demo --overwrite

test: install
	$(PY) -m pytest -q

test-slow: install
	$(PY) -m pytest -q -m slow

bench: install
	$(PY) bench/bench.py

clean:
	rm -rf $(VENV) out .pytest_cache
