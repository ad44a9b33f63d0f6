# The two commands that matter: `make demo` (the main job) and `make test`.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test install compare bench bench-peers-venv clean

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e ".[test,hf]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/python scripts/demo.py --workdir workdir/demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n 2 tests

# GRPO, PBSD, OPSD, RLSD and GEAR, and PBSD's ablations, x 3 seeds from one SFT checkpoint
# -> docs/results.md; PBSD with fresh vs replayed MoE routing on tiny-moe -> docs/results_moe.md
# (hours on 2 CPU cores; resumable: re-run to continue).
compare: $(STAMP)
	$(VENV)/bin/python scripts/compare.py --workdir workdir/compare --ablations all
	$(VENV)/bin/python scripts/compare.py --workdir workdir/compare_moe \
	    --config.model.name=tiny-moe --methods pbsd --ablations all \
	    --results docs/results_moe.md

# Side-by-side benchmarks (docs/benchmarks.md); the peers need their own venv first.
bench-peers-venv:
	$(PYTHON) -m venv benchmarks/.venv-peers
	benchmarks/.venv-peers/bin/pip install -q -r benchmarks/requirements-peers.txt

bench: $(STAMP)
	$(VENV)/bin/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) workdir
