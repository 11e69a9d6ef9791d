"""A non-image row: examples/tabular.py's MLP with and without LP-A3, several seeds.

    python benchmarks/tabular_table.py [--datasets breast_cancer digits] [--seeds 0 1 2 3 4] \
        [--epochs 30] [--jobs 2 --threads 1] [--out runs/tabular]

Data sets bundled with scikit-learn (no download): ``breast_cancer`` (569 rows, 30 features, 2
classes) and ``digits`` (1,797 rows, 10 classes: 8 x 8 images read as 64 plain features, the
largest bundled classification set). Each run: a stratified 75 / 25 split by its seed, features
standardised on the training rows, the MLP trained for ``--epochs`` with Adam; with LP-A3 as the
example sets it (ratio 0.5, sigma 0.02, one warm-up epoch, each feature's training range as the
input box). Prints test accuracy (mean +- std over the seeds) and training wall time per method;
each run's time is measured in its own process (with ``--jobs 1`` alone on the machine).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import Table, mean_std, sweep_main, write_result  # noqa: E402

DATASETS = ("breast_cancer", "digits")
METHODS = ("baseline", "lpa3")


def _worker(dataset: str, method: str, seed: int, epochs: int, out: Path) -> None:
    import importlib.util

    import sklearn.datasets

    spec = importlib.util.spec_from_file_location("tabular_example", ROOT / "examples" / "tabular.py")
    example = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(example)  # type: ignore[union-attr]
    start = time.perf_counter()
    logged = example.main(lpa3=method == "lpa3", seed=seed, max_epochs=epochs,
                          dataset=getattr(sklearn.datasets, f"load_{dataset}"), default_root_dir=str(out / "lightning"))
    write_result(out / f"{dataset}_{method}_{seed}.json", {
        "dataset": dataset, "method": method, "seed": seed, "epochs": epochs, "test_acc": logged["test/acc"],
        "wall_s": time.perf_counter() - start,
        "perceptual_distance": logged.get("lpa3/perceptual_distance_epoch"),
        "label_preserved": logged.get("lpa3/label_preserved_epoch")})


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=DATASETS)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--epochs", type=int, default=30)


def summarize(args: argparse.Namespace, results: list[dict]) -> str:
    lines = [f"{'data set':14} {'method':9} {'seeds':>5} {'test acc':>16} {'wall s':>16}  per seed"]
    for dataset in args.datasets:
        for method in args.methods:
            mine = sorted((r for r in results if r["dataset"] == dataset and r["method"] == method),
                          key=lambda r: r["seed"])
            if mine:
                per_seed = " / ".join(f"{r['test_acc']:.3f}" for r in mine)
                lines.append(f"{dataset:14} {method:9} {len(mine):5d} {mean_std([r['test_acc'] for r in mine]):>16} "
                             f"{mean_std([r['wall_s'] for r in mine]):>16}  {per_seed}")
    return "\n".join(lines)


TABLE = Table(script=__file__, description=__doc__.splitlines()[0],
              keys=(("dataset", str), ("method", str), ("seed", int)), arguments=_arguments,
              runs=lambda args: [(d, m, s) for d in args.datasets for m in args.methods for s in args.seeds],
              result_path=lambda args, d, m, s: args.out / f"{d}_{m}_{s}.json",
              worker=lambda args, d, m, s: _worker(d, m, s, args.epochs, args.out),
              keep=lambda args, r: r["seed"] in args.seeds and r["epochs"] == args.epochs,
              summarize=summarize, out=ROOT / "runs" / "tabular", seeds=(0, 1, 2, 3, 4))


def main(argv: list[str] | None = None) -> None:
    sweep_main(TABLE, argv)


if __name__ == "__main__":
    main()
