# The two commands that matter: `make demo` (the main job) and `make test`.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test install compare bench bench-peers-venv clean

# XLA:CPU allocates each program's temporary buffers anew on every call; glibc maps the large
# ones fresh from the OS and faults every page in again (1.0-1.4 GB on each GRPO update of the
# benchmark shape: ~0.2 s of its 1.6-1.9 s, docs/benchmarks.md). tcmalloc keeps them. Used
# where installed (Debian / Ubuntu: apt install libtcmalloc-minimal4); everything runs the
# same without it, only slower.
TCMALLOC := $(firstword $(wildcard /usr/lib/*/libtcmalloc_minimal.so.4 /usr/lib/libtcmalloc_minimal.so.4))
PY := $(if $(TCMALLOC),LD_PRELOAD=$(TCMALLOC) )$(VENV)/bin/python

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e ".[test,hf]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py --workdir workdir/demo

test: $(STAMP)
	$(PY) -m pytest -q -n 2 tests

# GRPO, PBSD, OPSD, RLSD and GEAR, and PBSD's ablations, x 3 seeds from one SFT checkpoint
# -> docs/results.md; PBSD with fresh vs replayed MoE routing on tiny-moe -> docs/results_moe.md
# (hours on 2 CPU cores; resumable: re-run to continue).
compare: $(STAMP)
	$(PY) scripts/compare.py --workdir workdir/compare --ablations all
	$(PY) scripts/compare.py --workdir workdir/compare_moe \
	    --config.model.name=tiny-moe --methods pbsd --ablations all \
	    --results docs/results_moe.md

# Side-by-side benchmarks (docs/benchmarks.md); the peers need their own venv first.
bench-peers-venv:
	$(PYTHON) -m venv benchmarks/.venv-peers
	benchmarks/.venv-peers/bin/pip install -q -r benchmarks/requirements-peers.txt

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) workdir
