# The two commands a newcomer runs: `make run` and `make test`; `make check` is the inner loop.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# pytest processes at once (pytest-xdist, whole files to one process: module fixtures stay
# shared). Most tests wait on daemons, sockets and deadlines, so 3 beat 2 on 2 cores.
TEST_JOBS ?= 3
XDIST := -n $(TEST_JOBS) --dist loadfile

.PHONY: run test check lint types unit setup clean mutants mutants-after-unit faults faults-quick nft test-vllm vllm-if-present zero-copy-check

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU torch first, so NIXL's torch dependency does not pull a multi-GB CUDA build.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP) etcd

# The etcd discovery tests run a real etcd (Debian's etcd-server). Installed here only as root
# with apt and no etcd yet; never fails the build: without it those tests skip and say how.
# The previous release (CHANGELOG.md), built from its commit into .cache/release-<v>/venv,
# its dependencies taken from $(VENV) (no network, seconds); reused when built. The
# mixed-version tests (tests/test_versions.py) build it themselves if it is missing.
.PHONY: prev-release
prev-release: $(STAMP)
	$(PY) -m tests.support.prev_release

.PHONY: etcd
etcd:
	@if command -v etcd >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing etcd-server for the etcd discovery tests (apt-get)"; \
	  (apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server >/dev/null) \
	  || echo "etcd-server could not be installed; the etcd discovery tests will skip"; \
	else echo "no etcd (needs root and apt to install etcd-server): the etcd discovery tests will skip"; fi

# promtool checks the shipped Prometheus rules (tests/test_monitoring.py). Only the binary is
# taken from Debian's prometheus package, unpacked into the venv and never installed (the
# package would start a Prometheus server). Never fails the build: without it those tests skip.
.PHONY: promtool
promtool: $(STAMP)
	@if command -v promtool >/dev/null 2>&1 || [ -x $(VENV)/bin/promtool ]; then :; \
	elif command -v apt-get >/dev/null 2>&1 && command -v dpkg-deb >/dev/null 2>&1; then \
	  echo "fetching promtool for the monitoring tests (apt-get download prometheus)"; \
	  d=$$(mktemp -d); \
	  (cd $$d && { apt-get download -q prometheus >/dev/null 2>&1 \
	    || { [ "$$(id -u)" = 0 ] && apt-get update -q >/dev/null && apt-get download -q prometheus >/dev/null 2>&1; }; }) \
	  && dpkg-deb -x $$d/prometheus_*.deb $$d/x && install -m 0755 $$d/x/usr/bin/promtool $(VENV)/bin/promtool \
	  || echo "promtool could not be fetched; the promtool tests will skip"; \
	  rm -rf $$d; \
	else echo "no apt-get: the promtool tests will skip (put promtool on PATH)"; fi

run: $(STAMP)
	$(VENV)/bin/kvxferd demo

lint: $(STAMP)
	$(VENV)/bin/ruff check kvxferd tests tests_vllm scripts
	$(VENV)/bin/ruff format --check kvxferd tests tests_vllm scripts

types: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP) etcd promtool
	$(PY) -m pytest -q $(XDIST)

# The inner loop, under 3 minutes on 2 cores: lint, types and the tests not marked
# `integration` (those start daemons, CLI processes, etcd or real NIXL pairs: `make test`).
check: lint types
	$(PY) -m pytest -q $(XDIST) -m "not integration"

# mutants are part of every check: a guarded fix whose revert no test catches fails the build.
# (In `make test` pytest has just passed every test the mutants name: no baseline run.)
test: lint types unit mutants-after-unit vllm-if-present

# Revert each guarded fix in a copy of the tree; every one must make its tests fail
# (about 115 mutants, three at a time, each run forked from a server that imported torch,
# NIXL and pytest once: about 5.5 min on 2 cores).
mutants: $(STAMP)
	$(PY) tests/mutants.py

mutants-after-unit: $(STAMP)
	$(PY) tests/mutants.py --skip-baseline

# Real daemons through kills, stops, a partition, SIGTERM under load and a soak (a few minutes;
# the partition needs root, ip netns and nft), then the 15 s and 70 s partitions across 4
# namespace hosts (tests/test_partitions.py, about 2.5 min, root). Writes the suite's figures
# into docs/reliability.md and the partitions' into partitions.jsonl.
faults: $(STAMP) nft
	$(VENV)/bin/kvxferd faults --report docs/reliability.md
	KVXFERD_PARTITIONS=1 KVXFERD_HOSTS_FIGURES=partitions.jsonl $(PY) -m pytest -q -s tests/test_partitions.py

# The namespace-host tests cut links with nftables (Debian's nftables). Installed here only as
# root with apt and no nft yet; never fails the build: without it those tests skip and say how.
.PHONY: nft
nft:
	@if command -v nft >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing nftables for the namespace-host tests (apt-get)"; \
	  (apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q nftables >/dev/null) \
	  || echo "nftables could not be installed; the namespace-host tests will skip"; \
	else echo "no nft (needs root and apt to install nftables): the namespace-host tests will skip"; fi

faults-quick: $(STAMP)
	$(VENV)/bin/kvxferd faults --quick

# vLLM is heavy (a 4 GB environment, about 3 min to install): its own venv, made by test-vllm.
VLLM_VENV  ?= .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q "torch==2.13.0"
	$(VLLM_PY) -m pip install -q -e ".[dev,vllm]"
	# vLLM's CPU path needs none of these, and with them `from vllm import LLM` fails.
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# Real prefill and decode vLLM engines moving KV through real daemons (tests_vllm/, a few minutes).
test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q tests_vllm

# `make test` runs the vLLM tests only where their environment already exists.
vllm-if-present:
	@if [ -x $(VLLM_PY) ]; then $(MAKE) --no-print-directory test-vllm; \
	else echo "make test: vLLM tests skipped (no $(VLLM_VENV); 'make test-vllm' creates it and runs them)"; fi

# The GPU zero-copy path on a host with CUDA (docs/gpu.md); exit 77 where there is none.
zero-copy-check: $(STAMP)
	$(PY) scripts/zero_copy_check.py --device cuda

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .cache
