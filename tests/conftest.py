"""Test-run settings shared by every test module.

Under pytest-xdist (``make test`` runs ``pytest -n auto``) each worker gets an equal share of the CPU's
cores as torch threads, and the processes a test starts (DDP ranks, benchmark scripts, CLI runs) inherit
the same share through ``OMP_NUM_THREADS``: without it two workers each take every core and the run
is slower than one worker, and a test comparing a subprocess's numbers with its own would compare two
thread counts. A plain ``pytest`` run (no workers) keeps torch's default.
"""

from __future__ import annotations

import os


def _threads_per_worker() -> int | None:
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers:
        return None
    return max(1, (os.cpu_count() or 1) // int(workers))


_THREADS = _threads_per_worker()
if _THREADS is not None:
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(_THREADS)
    import torch

    torch.set_num_threads(_THREADS)
