# The two commands a newcomer needs: `make demo` and `make test`.
# Both need only Python 3.11+ and make: Redis and PostgreSQL are used if they
# answer locally (or at REDIS_URL / DB_URL), and started embedded otherwise.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test lint bench chaos compat clean

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
	$(PY) -m devtools.imports

test: lint
	$(PY) -m pytest -q

# The reliability suite: the shop under load while replicas die and servers restart.
chaos: $(VENV)/.installed
	$(PY) -m pytest -q -m chaos tests/chaos

# The oldest and the newest Dramatiq the kit supports (docs/internals.md).
COMPAT_DRAMATIQ ?= 2.2.0 2.2.1
COMPAT := .compat

# The type check and the suite against each of COMPAT_DRAMATIQ, each in a throwaway
# virtualenv under $(COMPAT)/; fails if any version fails.
compat:
	@rm -rf $(COMPAT); failed=""; summary=""; \
	for version in $(COMPAT_DRAMATIQ); do \
		venv=$(COMPAT)/dramatiq-$$version; started=$$(date +%s); \
		echo "== Dramatiq $$version: installing into $$venv"; \
		if $(PYTHON) -m venv $$venv \
			&& $$venv/bin/python -m pip install --quiet --upgrade pip \
			&& $$venv/bin/python -m pip install --quiet -e '.[dev]' "dramatiq[redis]==$$version" \
			&& $$venv/bin/python -c "import dramatiq, sys; sys.exit(dramatiq.__version__ != '$$version')" \
			&& $$venv/bin/python -m mypy --cache-dir $$venv/.mypy_cache \
			&& $$venv/bin/python -m pytest -q -p no:cacheprovider; \
		then result=passed; else result=FAILED; failed="$$failed $$version"; fi; \
		rm -rf $$venv; \
		line="Dramatiq $$version: $$result in $$(( $$(date +%s) - started )) s"; \
		echo "== $$line"; summary="$$summary$$line\n"; \
	done; \
	rm -rf $(COMPAT); printf "make compat:\n$$summary"; \
	test -z "$$failed"

bench: $(VENV)/.installed
	$(PY) -m devtools.services run -- $(PY) -m benchmarks overhead

clean:
	rm -rf $(VENV) .services .pytest_cache .mypy_cache .ruff_cache
