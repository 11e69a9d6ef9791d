"""The chaos run: SIGKILL training at random moments, relaunch it from its last checkpoint, and
compare its end bitwise with the same fit run without interruption.

    python benchmarks/chaos_resume.py [--seed 0] [--kills 16] [--out runs/chaos]
    python benchmarks/chaos_resume.py --fast   # the suite's variant (tests/test_chaos_resume.py)

Each scenario is one fit: 48 samples, 3 epochs of 3 steps (each process's batches), epoch 0 a
warm-up without ``x'``, validation at every epoch's end, SGD with momentum and a StepLR schedule,
LPA3Callback, the global generator saved with each checkpoint (``GlobalRandomState``) and a
checkpoint at every step (``ModelCheckpoint(every_n_train_steps=1, save_top_k=0, save_last=True)``).
The scenarios: one process and two (DDP, gloo, Lightning's launcher), without the ``x'`` cache and
with it (K=2, ``cache.in_checkpoint=True``) in memory or on disk (``max_bytes=0``); and each ready
module (FixMatch, PES, DivideMix) on its own data module, one process, 3 steps an epoch
(``tests/modules/test_ready_resume.py``'s settings: FixMatch on MNIST-5k with its EMA, PES and
DivideMix on BreastMNIST with flipped labels, through their phases). Each runs once
without interruption, then under its kills: every launch resumes from ``last.ckpt`` and is
SIGKILLed at its kill (under DDP on one rank, drawn at random; the other rank then fails and the
job is cleaned up, as a scheduler's requeue would), and a last launch trains to the end.

Kill points: an epoch's first step (its ``on_train_batch_start``: the last checkpoint is the
previous epoch's last batch), a middle step, an epoch's last step (after its checkpoint, before
the epoch's end), during the epoch-end validation, and while a step's checkpoint is written
(the previous ``last.ckpt`` must still load); in the warm-up (epoch 0) and after it.

Compared bitwise (the bits of every tensor, NaN included) on every rank: weights and buffers,
optimizer, scheduler, the TCS memory, the ``x'`` cache, LPA3Callback's state, Lightning's step
counters, and (one process, and rank 0) torch's global generator. Under DDP the network has no
BatchNorm and no dropout: their per-rank state is not in a checkpoint (docs/multinode.md).

Printed: the seed and the kill schedule (so a failure can be replayed with ``--seed``), each kill
as it happened, whether the previous checkpoint loaded after a kill during a write, whether a
cache file was left behind, and each scenario's verdict. Exit status 1 on any difference.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

EPOCHS, BATCHES, N = 3, 3, 48  # 3 steps an epoch on every process
POINTS = ("epoch_first_step", "mid_epoch", "checkpoint_write", "epoch_last_step", "validation")
#: the scenarios: (processes, cache) with cache one of none, memory, file; the supervised mixin on a small CNN,
#: or a ready module on its own data module (READY)
SCENARIOS = {"1proc": (1, "none"), "1proc_cache_memory": (1, "memory"), "1proc_cache_file": (1, "file"),
             "ddp": (2, "none"), "ddp_cache_file": (2, "file"),
             "fixmatch": (1, "none"), "pes": (1, "none"), "dividemix": (1, "none")}
#: the ready modules' scenarios, each on its own data module with 3 steps an epoch (tests/modules/test_ready_resume.py)
READY = ("fixmatch", "pes", "dividemix")


@dataclass(frozen=True, order=True)
class Kill:
    """A SIGKILL at ``point`` of (``epoch``, ``batch``) on ``rank``; ordered by when it happens."""

    epoch: int
    batch: int
    phase: int  # the order of the points within one step
    point: str
    rank: int = 0

    @classmethod
    def at(cls, point: str, epoch: int, batch: int, rank: int = 0) -> Kill:
        phase = {"epoch_first_step": 0, "mid_epoch": 0, "checkpoint_write": 1, "epoch_last_step": 2, "validation": 3}
        return cls(epoch, batch, phase[point], point, rank)

    @property
    def step(self) -> int:
        """The global step the point belongs to (a checkpoint's: after the batch's optimizer step)."""
        return self.epoch * BATCHES + self.batch + (1 if self.phase else 0)

    def spec(self) -> str:
        return f"{self.point}:{self.epoch}:{self.batch}:{self.rank}"

    def __str__(self) -> str:
        warm = "warm-up" if self.epoch == 0 else "after warm-up"
        return f"{self.point} epoch {self.epoch} batch {self.batch} rank {self.rank} ({warm})"


def candidates(world: int) -> list[Kill]:
    """Every kill point of a scenario (under DDP a checkpoint is written by rank 0 only)."""
    out = []
    for epoch in range(EPOCHS):
        out += [Kill.at("epoch_first_step", epoch, 0), Kill.at("mid_epoch", epoch, 1),
                Kill.at("epoch_last_step", epoch, BATCHES - 1), Kill.at("validation", epoch, BATCHES - 1)]
        out += [Kill.at("checkpoint_write", epoch, batch) for batch in range(BATCHES)]
    return out


def draw_schedule(seed: int, kills: int, scenarios: list[str]) -> dict[str, list[Kill]]:
    """``kills`` kills spread over ``scenarios`` (each distinct and in the order they happen), drawn
    until every point, the warm-up and after it, and (with a DDP scenario) both ranks appear."""
    rng = random.Random(seed)
    share = [kills // len(scenarios) + (k < kills % len(scenarios)) for k in range(len(scenarios))]
    while True:
        schedule = {}
        for name, count in zip(scenarios, share):
            world = SCENARIOS[name][0]
            drawn = rng.sample(candidates(world), count)
            schedule[name] = sorted(Kill.at(k.point, k.epoch, k.batch, 0 if k.point == "checkpoint_write"
                                            else rng.randrange(world)) for k in drawn)
        every = [k for ks in schedule.values() for k in ks]
        ranks = {k.rank for name, ks in schedule.items() if SCENARIOS[name][0] > 1 for k in ks}
        if ({k.point for k in every} == set(POINTS) and {k.epoch == 0 for k in every} == {True, False}
                and (ranks == {0, 1} or all(SCENARIOS[name][0] == 1 for name in scenarios))):
            return schedule


FAST = {"1proc_cache_memory": [Kill.at("epoch_last_step", 0, BATCHES - 1), Kill.at("validation", 1, BATCHES - 1)],
        "ddp": [Kill.at("mid_epoch", 1, 1, rank=1)]}


# ---------------------------------------------------------------------------------------- the fit
def worker(out: Path, world: int, cache: str, kill: Kill | None, ready: str | None = None) -> None:
    """One launch of a scenario's fit in ``out``: resumed from ``out/ckpt/last.ckpt`` when there
    is one, SIGKILLed at ``kill``; at the end each rank writes ``out/final_rank{R}.pt``. ``ready``:
    one of :data:`READY`, the ready module on its data module instead of the supervised mixin."""
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch.utils.data import DataLoader

    from lpa3_lightning import LPA3Callback
    from lpa3_lightning.data import train_loader
    from tests.callback.test_lpa3_callback import TinyClassifier
    from tests.ddp.run_ddp import no_bn_net
    from tests.helpers import GlobalRandomState, indexed_images
    from tests.resume.run_resume import KillWhileWriting

    torch.set_num_threads(1)

    def die(trainer: pl.Trainer) -> None:
        with open(out / "killed.txt", "a") as note:  # what happened, for the driver (before the kill)
            note.write(f"{kill.spec()} step {trainer.global_step}\n")
            note.flush()
            os.fsync(note.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    def due(trainer: pl.Trainer, epoch: int, batch: int) -> bool:
        return kill is not None and trainer.global_rank == kill.rank and (epoch, batch) == (kill.epoch, kill.batch)

    def hooked(cls: type) -> type:
        """``cls`` with the kill of an epoch's last step in its own ``on_train_batch_end`` (a module's hook
        runs after every callback's, ModelCheckpoint's save included)."""

        class Killed(cls):
            def on_train_batch_end(self, outputs, batch, batch_idx):
                super().on_train_batch_end(outputs, batch, batch_idx)
                if kill is not None and kill.point == "epoch_last_step" and due(self.trainer, self.current_epoch,
                                                                                 batch_idx):
                    die(self.trainer)

        return Killed

    class Chaos(TinyClassifier):
        """The supervised mixin with validation and a schedule; under DDP without BatchNorm and dropout."""

        def __init__(self) -> None:
            super().__init__(twin_bn=world == 1)
            if world > 1:
                torch.manual_seed(0)
                self.model = no_bn_net()

        def validation_step(self, batch, batch_idx):
            x, y, _ = batch
            self.log("val/loss", F.cross_entropy(self.model(x), y), sync_dist=True)

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)]

        def on_train_batch_end(self, outputs, batch, batch_idx):
            # a module's hook runs after every callback's, ModelCheckpoint's save included
            if kill is not None and kill.point == "epoch_last_step" and due(self.trainer, self.current_epoch, batch_idx):
                die(self.trainer)

    class KillAt(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if kill.point in ("epoch_first_step", "mid_epoch") and due(trainer, trainer.current_epoch, batch_idx):
                die(trainer)

        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            if kill.point == "validation" and batch_idx == 0 and due(trainer, trainer.current_epoch, BATCHES - 1):
                die(trainer)

        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            if kill.point == "checkpoint_write" and trainer.global_rank == 0 and trainer.global_step == kill.step:
                with open(out / "killed.txt", "a") as note:
                    note.write(f"{kill.spec()} step {trainer.global_step}\n")
                # SIGKILL right after the file that becomes last.ckpt is opened for writing
                KillWhileWriting(out / "ckpt", kill.step).on_save_checkpoint(trainer, pl_module, checkpoint)

    pl.seed_everything(0)
    settings = {"none": {}, "memory": {"regenerate_every_n_epochs": 2, "in_checkpoint": True},
                "file": {"regenerate_every_n_epochs": 2, "in_checkpoint": True, "max_bytes": 0,
                         "dir": str(out / "cache")}}[cache]
    extra: list = []
    if ready is None:
        lpa3 = LPA3Callback(ratio=0.5, steps=2, seed=0, warmup_epochs=1, cache=settings)
        module, fit_data = Chaos(), {}
    else:  # the ready module and its data module, each epoch 3 steps (validation: the data module's, one batch)
        from tests.modules.test_ready_resume import ready_setting

        data, module, lpa3, _, extra = ready_setting(ready, out, batches_per_epoch=BATCHES, wrap=hooked)
        fit_data = {"datamodule": data}
    callbacks = [lpa3, *extra, GlobalRandomState(),
                 ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=1, save_top_k=0, save_last=True)]
    if kill is not None:
        callbacks.append(KillAt())
    trainer = pl.Trainer(max_epochs=EPOCHS, accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto",
                         deterministic=True, callbacks=callbacks, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=out,
                         limit_val_batches=1 if ready else 1.0)
    last = out / "ckpt" / "last.ckpt"
    if ready is None:
        loader = train_loader(indexed_images(N), N // (BATCHES * world), seed=0, num_replicas=trainer.world_size,
                              rank=trainer.global_rank)
        fit_data = {"train_dataloaders": loader, "val_dataloaders": DataLoader(indexed_images(16, seed=1), batch_size=8)}
    trainer.fit(module, **fit_data, ckpt_path=last if last.exists() else None)
    runner = lpa3.runner() if not lpa3.networks else next(iter(lpa3.networks.values()))
    state = {"weights": module.state_dict(), "optimizers": [o.state_dict() for o in trainer.optimizers],
             "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
             "tcs": runner.tcs.state_dict(), "callback": lpa3.state_dict(),
             "cache": None if runner.store is None else runner.store.state_dict(include_inputs=True),
             "loop": {"global_step": trainer.global_step, "epoch": trainer.current_epoch,
                      "batches_that_stepped": trainer.fit_loop.epoch_loop._batches_that_stepped},
             "generator": torch.get_rng_state() if trainer.global_rank == 0 else None}
    torch.save(state, out / f"final_rank{trainer.global_rank}.pt")
    if torch.distributed.is_initialized():  # (left to interpreter exit, gloo's threads can abort the process)
        torch.distributed.destroy_process_group()


# ---------------------------------------------------------------------------------------- the driver
def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ: tensors compared bit for bit (NaN included), the rest by ``==``."""
    import torch

    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(set(a) ^ set(b), key=str)}"]
        return [d for key in a for d in differences(a[key], b[key], f"{where}/{key}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: lengths {len(a)} and {len(b)}"]
        return [d for k, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{k}]")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{where}: {a.dtype}{tuple(a.shape)} and {b.dtype}{tuple(b.shape)}"]
        if a.is_floating_point():  # the bits: NaN equals NaN, -0.0 differs from 0.0
            bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
            a, b = a.contiguous().view(bits), b.contiguous().view(bits)
        return [] if torch.equal(a, b) else [f"{where}: {int((a != b).sum())} of {a.numel()} values differ"]
    return [] if a == b else [f"{where}: {a!r} and {b!r}"]


def launch(out: Path, world: int, cache: str, kill: Kill | None, timeout: float = 300, ready: str | None = None) -> int:
    """One launch of the worker (its own process group: a DDP job's ranks end with it)."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(out), "--world", str(world),
               "--cache", cache] + ([] if kill is None else ["--kill", kill.spec()]) + \
        ([] if ready is None else ["--ready", ready])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(out / "launches.log", "a") as log:
        job = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
        try:
            code = job.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        # a lost rank: the other one fails at its next collective; what is left ends here
        deadline = time.monotonic() + (30 if code is not None and world > 1 else 0)
        while time.monotonic() < deadline and _group_alive(job.pid):
            time.sleep(0.5)
        if _group_alive(job.pid):
            os.killpg(job.pid, signal.SIGKILL)
    if code is None:
        raise RuntimeError(f"{out}: the launch did not end in {timeout} s (a hang); its log: {out / 'launches.log'}")
    return code


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def run_scenario(name: str, kills: list[Kill], out: Path) -> bool:
    """The scenario uninterrupted and under ``kills``; prints each kill and the verdict."""
    import torch

    world, cache = SCENARIOS[name]
    ready = name if name in READY else None
    started = time.monotonic()
    reference, chaos = out / name / "uninterrupted", out / name / "chaos"
    ok = True
    if launch(reference, world, cache, None, ready=ready) != 0:
        print(f"  {name}: the uninterrupted run failed (log: {reference / 'launches.log'})")
        return False
    for kill in kills:
        before = _last_step(chaos)
        code = launch(chaos, world, cache, kill, ready=ready)
        noted = (chaos / "killed.txt").read_text().splitlines() if (chaos / "killed.txt").exists() else []
        hit = bool(noted) and noted[-1].startswith(kill.spec())
        after = _last_step(chaos)
        line = f"  kill {kill}: exit {code}, {'killed there' if hit else 'NOT KILLED THERE'}; last.ckpt step {before} -> {after}"
        if kill.point == "checkpoint_write":  # the last.ckpt of the step before (none before the first)
            usable = after == (kill.step - 1 if kill.step > 1 else None)
            kept = "the previous checkpoint usable" if kill.step > 1 else "no last.ckpt (there was none before)"
            line += f"; the interrupted write left {kept if usable else 'an UNUSABLE or wrong last.ckpt'}"
            ok &= usable
        if cache == "file":
            left = sorted(p.name for p in (chaos / "cache").glob("*")) if (chaos / "cache").exists() else []
            line += f"; cache files left: {left or 'none'}"
            ok &= not left
        print(line, flush=True)
        ok &= hit and code != 0
    if launch(chaos, world, cache, None, ready=ready) != 0:
        print(f"  {name}: the last launch failed (log: {chaos / 'launches.log'})")
        return False
    for rank in range(world):
        a = torch.load(reference / f"final_rank{rank}.pt", weights_only=False)
        b = torch.load(chaos / f"final_rank{rank}.pt", weights_only=False)
        found = differences(a, b)
        print(f"  {name} rank {rank}: {'bitwise equal' if not found else 'DIFFERENT: ' + '; '.join(found[:5])} "
              f"({', '.join(a)})")
        ok &= not found
    print(f"  {name}: {len(kills)} kills, {time.monotonic() - started:.0f} s", flush=True)
    return ok


def _last_step(out: Path) -> int | None:
    """The global step of ``out/ckpt/last.ckpt`` (None: none yet; -1: it does not load)."""
    import torch

    path = out / "ckpt" / "last.ckpt"
    if not path.exists():
        return None
    try:
        return int(torch.load(path, weights_only=False, map_location="cpu")["global_step"])
    except Exception:  # noqa: BLE001 (any failure to load is the finding: an unusable checkpoint)
        return -1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="the schedule's seed (printed: replay a failure with it)")
    parser.add_argument("--kills", type=int, default=16, help="kills over all scenarios (>= 10)")
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "chaos")
    parser.add_argument("--fast", action="store_true", help="the suite's variant: an epoch's end, a validation, "
                        "one DDP kill")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--cache", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--kill", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ready", default=None, choices=READY, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        kill = None
        if args.kill:
            point, epoch, batch, rank = args.kill.split(":")
            kill = Kill.at(point, int(epoch), int(batch), int(rank))
        worker(args.worker, args.world, args.cache, kill, args.ready)
        return
    print(f"chaos run: seed {args.seed}{' (fast variant: a fixed schedule)' if args.fast else ''}; out {args.out}")
    schedule = FAST if args.fast else draw_schedule(args.seed, args.kills, args.scenarios)
    total = sum(len(kills) for kills in schedule.values())
    print(f"kill schedule ({total} kills):")
    for name, kills in schedule.items():
        world, cache = SCENARIOS[name]
        print(f"  {name} ({world} process{'es' if world > 1 else ''}, x' cache: {cache}): "
              + "; ".join(str(k) for k in kills))
    started, ok = time.monotonic(), True
    for name, kills in schedule.items():
        ok &= run_scenario(name, kills, args.out)
    print(f"verdict: {'every scenario bitwise equal to its uninterrupted run' if ok else 'FAILED'} "
          f"({total} kills, {time.monotonic() - started:.0f} s)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
