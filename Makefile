# The two commands of the README: `make run` (the main job: HSTU on MovieLens-100k compiled with rec_ascend)
# and `make test` (the test suite).
# Both create the virtual environment themselves on a fresh machine.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha1sum | cut -c1-12)
# The 25 slowest tests are printed, so that a test growing slow is seen.
PYTEST_ARGS ?= -n 2 --durations=25
# The extras the venv installs beside the package (pyproject.toml).
EXTRAS := test,torchrec,tf,docs

.PHONY: venv browser run test test-slow wheel-check bench clean

$(STAMP):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: the package's native kernels are built against it, without build isolation.
	$(PY) -m pip install -q torch==2.13.0 setuptools
	# The native kernels compile (build/native, setup.py) while pip installs the declared dependencies; the
	# editable install after both then finds every object up to date and only links.
	$(PY) -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
	    print(*p['dependencies'], *(r for e in '$(EXTRAS)'.split(',') for r in p['optional-dependencies'][e]), sep='\n')" \
	    > $(VENV)/requirements.txt
	$(PY) setup.py -q build_ext --inplace > $(VENV)/native-build.log 2>&1 & build=$$!; \
	$(PY) -m pip install -q -r $(VENV)/requirements.txt || { kill $$build; exit 1; }; \
	wait $$build || { cat $(VENV)/native-build.log; exit 1; }
	$(PY) -m pip install -q --no-build-isolation -e '.[$(EXTRAS)]'
	# torchrec and recbole (the MovieLens-100k data carrier and the test corpus's RecBole models) without their
	# dependency pins: torchrec's would replace fbgemm-gpu-cpu with the CUDA build, recbole's pull ray and thop;
	# the runtime packages RecBole's modules import are in the test extra.
	$(PY) -m pip install -q --no-deps torchrec==1.8.0 recbole==1.2.1
	rm -f $(VENV)/.installed-*
	touch $@

venv: $(STAMP)

run: venv
	$(PY) -m models.main

# The HTML report's test loads it in a real browser: Debian's chromium, installed when missing.
browser:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

# `make test` leaves out the tests marked slow (the long tail: each has a smaller variant in this run);
# `make test-slow` runs them, outside CI (CI runs `make test` and `make wheel-check`; docs/testing.md).
test: venv browser
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-slow: venv browser
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

# The wheel built from this tree, installed into a fresh venv with its dependencies, compiles a zoo model.
wheel-check: venv
	$(PY) .ci/wheel_check.py

clean:
	rm -rf $(VENV) .pytest_cache
