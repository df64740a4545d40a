# make demo   - the CPU demo end to end (train tiny models, evaluate passkey retrieval, write figures)
# make test   - the default test suite (what CI runs)
# Both use the active virtual environment, or create .venv and install requirements.txt into it.
ifdef VIRTUAL_ENV
PYTHON := $(VIRTUAL_ENV)/bin/python
STAMP := $(VIRTUAL_ENV)/.bam-gpt-requirements
else
PYTHON := .venv/bin/python
STAMP := .venv/.bam-gpt-requirements
endif

.PHONY: deps test test-all

$(STAMP): requirements.txt
	@test -x $(PYTHON) || python3 -m venv .venv
	$(PYTHON) -m pip install -q -r requirements.txt
	@touch $(STAMP)

deps: $(STAMP)

test: deps
	$(PYTHON) -m pytest -q -m "not slow" tests/

test-all: deps
	$(PYTHON) -m pytest -q tests/
