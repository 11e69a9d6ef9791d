# Two commands do all the set-up on a fresh machine (each creates the venv when missing):
#   make demo   train the default job (BreastMNIST + LP-A3, data shipped in the package)
#   make test   run the test suite (pytest-xdist, one worker a core; tests/conftest.py shares the threads)
# make venv installs only; make smoke runs the demo's whole path in a few steps.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo smoke test venv clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e ".[dev]"
	touch $@

demo: venv
	$(BIN)/lpa3 fit --config configs/medmnist/demo_breastmnist_lpa3.yaml

smoke: venv
	$(BIN)/lpa3 fit --config configs/medmnist/demo_breastmnist_lpa3.yaml --trainer.max_epochs 2 \
		--trainer.limit_train_batches 3 --trainer.limit_val_batches 2 --trainer.limit_test_batches 2 \
		--trainer.default_root_dir runs/smoke --trainer.logger.init_args.save_dir runs/smoke

test: venv
	$(BIN)/python -m pytest -q -n auto --dist worksteal

clean:
	rm -rf runs lightning_logs .pytest_cache
