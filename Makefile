# Two commands do all the set-up on a fresh machine (each creates the venv when missing):
#   make demo   train the default job (BreastMNIST + LP-A3, data shipped in the package)
#   make test   run the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test venv clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e ".[dev]"
	touch $@

demo: venv
	$(BIN)/lpa3 fit --config configs/medmnist/demo_breastmnist_lpa3.yaml

test: venv
	$(BIN)/python -m pytest -q

clean:
	rm -rf runs lightning_logs .pytest_cache
