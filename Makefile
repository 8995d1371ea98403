# `make demo` and `make test` do all set-up on a fresh machine; `make bench` prints the benchmark tables.
# The virtual environment lives in .venv at the repo root and is (re)installed when its inputs change.

PYTHON ?= python3.11
VENV := .venv
VPY := $(VENV)/bin/python
# The CPU wheel of torch this project's machines ship; GPU machines install their own torch first.
TORCH_SPEC ?= torch==2.13.0
SGLANG_SPEC ?= sglang==0.5.23
STAMP := $(VENV)/.installed

.PHONY: test demo demo-loop bench install clean-venv

# Two workers, whole modules each (their servers are shared within a module), the longest modules first:
# the suite mostly waits on one-threaded server starts, so two workers on two cores halve its wall time.
# The 15 slowest tests are listed at the end: the suite must stay under 45 minutes on a fresh 2-core clone.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(VPY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

# The whole pipeline on this machine (about 3 minutes on 2 cores); an earlier demo-run/ is replaced.
demo: $(STAMP)
	$(VPY) -m eagle_tap.cli demo --out demo-run --replace

# The closed loop: a draft trained on one domain, traffic shifted to another, rounds swapped into two replicas.
demo-loop: $(STAMP)
	$(VPY) -m eagle_tap.cli demo --loop --out demo-loop-run --replace

# Every benchmark in one run: bench-results/bench.json and bench.md.
bench: $(STAMP)
	$(VPY) -m eagle_tap.cli bench --out bench-results

install: $(STAMP)

# pip must never resolve sglang's own requirements (a CUDA torch and GBs of GPU packages): torch is
# installed first, sglang with --no-deps, then the pinned list of what sglang imports at run time.
$(STAMP): pyproject.toml requirements/sglang-cpu.txt Makefile
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	$(VPY) -m pip install --quiet "$(TORCH_SPEC)"
	$(VPY) -m pip install --quiet --no-deps "$(SGLANG_SPEC)"
	$(VPY) -m pip install --quiet -r requirements/sglang-cpu.txt
	$(VPY) -m pip install --quiet -e ".[all,dev]"
	touch $(STAMP)

clean-venv:
	rm -rf $(VENV)
