# The README's two commands: `make demo` (generate, then dispatch the generated kernels)
# and `make test` (the test suite, as CI runs it). Both install what they need first.
PYTHON ?= python3
export TRITON_DEFAULT_FP_FUSION ?= 1

.PHONY: setup generate demo test

setup:
	@# torch first and pinned: an unpinned `pip install torch` pulls GBs of CUDA wheels.
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e ".[test]"
	@# Fail here, naming the package, rather than at the first interpreted kernel.
	$(PYTHON) -c "import numpy, triton, pydantic, jinja2, pytest"

generate: setup
	$(PYTHON) -m kdsl generate

demo: generate
	@if $(PYTHON) -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then \
		$(PYTHON) -m kdsl demo; \
	else \
		echo "no CUDA GPU: running the generated kernels through Triton's interpreter"; \
		TRITON_INTERPRET=1 $(PYTHON) -m kdsl demo; \
	fi

test: setup
	$(PYTHON) -m kdsl generate --check
	$(PYTHON) -m pytest -q
