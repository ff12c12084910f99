# The two commands a newcomer needs: `make demo` and `make test`.
# Both need only Python 3.11+ and make: Redis and PostgreSQL are used if they
# answer locally (or at REDIS_URL / DB_URL), and started embedded otherwise.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test lint bench chaos clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

demo: $(VENV)/.installed
	$(PY) -m devtools.services run -- $(PY) -m examples.shop.demo

lint: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

test: lint
	$(PY) -m pytest -q

# The reliability suite: the shop under load while replicas die and servers restart.
chaos: $(VENV)/.installed
	$(PY) -m pytest -q -m chaos tests/chaos

bench: $(VENV)/.installed
	$(PY) -m devtools.services run -- $(PY) -m benchmarks overhead

clean:
	rm -rf $(VENV) .services .pytest_cache .mypy_cache .ruff_cache
