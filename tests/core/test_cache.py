"""AugmentationCache: expiry after K epochs, memory bound, memory-mapped store, state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lpa3_lightning.core.cache import AugmentationCache, assemble_inputs, plan_rows


def test_entries_expire_after_k_epochs():
    cache = AugmentationCache(5, every_n_epochs=3)
    cache.put(torch.tensor([0, 2]), torch.arange(8.0).view(2, 4), epoch=1)
    assert cache.fresh(torch.tensor([0, 1, 2]), epoch=1).tolist() == [True, False, True]
    assert cache.fresh(torch.tensor([0, 2]), epoch=3).tolist() == [True, True]
    assert cache.fresh(torch.tensor([0, 2]), epoch=4).tolist() == [False, False]
    assert torch.equal(cache.get(torch.tensor([2])), torch.arange(4.0, 8.0).view(1, 4))
    cache.put(torch.tensor([2]), torch.zeros(1, 4), epoch=4)  # regenerated: young again
    assert cache.fresh(torch.tensor([2]), epoch=6).tolist() == [True]


def test_in_memory_up_to_the_bound_then_refused_without_a_directory():
    small = AugmentationCache(10, 2, max_bytes=10 * 4 * 4)
    small.put(torch.tensor([1]), torch.ones(1, 4), epoch=0)
    assert small.file is None and small.nbytes == 160
    too_big = AugmentationCache(10, 2, max_bytes=100)
    with pytest.raises(ValueError, match="cache.dir"):
        too_big.put(torch.tensor([1]), torch.ones(1, 4), epoch=0)


def test_memory_mapped_store_is_a_per_run_file_and_restarts_empty_on_resume(tmp_path):
    cache = AugmentationCache(6, 2, max_bytes=0, directory=tmp_path / "c")
    x = torch.randn(3, 2, 3)
    cache.put(torch.tensor([5, 0, 2]), x, epoch=0)
    assert cache.file is not None and cache.nbytes == 6 * 6 * 4  # (its name already removed: see below)
    assert torch.equal(cache.get(torch.tensor([5, 0, 2])), x)
    other = AugmentationCache(6, 2, max_bytes=0, directory=tmp_path / "c")
    other.put(torch.tensor([1]), torch.zeros(1, 2, 3), epoch=0)
    assert other.file != cache.file  # concurrent runs never share a file
    state = cache.state_dict()
    assert state["storage"] is None and bool((state["written"] == -1).all())
    restored = AugmentationCache(6, 2, max_bytes=0, directory=tmp_path / "c")
    restored.load_state_dict(state)
    assert restored.fresh(torch.tensor([5, 0, 2]), epoch=1).tolist() == [False, False, False]


def test_in_memory_state_round_trip_and_size_check():
    cache = AugmentationCache(4, 2)
    cache.put(torch.tensor([3]), torch.full((1, 2), 7.0), epoch=2)
    restored = AugmentationCache(4, 2)
    restored.load_state_dict(cache.state_dict(include_inputs=True))
    assert torch.equal(restored.get(torch.tensor([3])), torch.full((1, 2), 7.0))
    with pytest.raises(ValueError, match="same training data"):
        AugmentationCache(5, 2).load_state_dict(cache.state_dict())


def test_checkpoint_state_holds_no_inputs_unless_asked():
    cache = AugmentationCache(4, 2)
    cache.put(torch.tensor([3]), torch.full((1, 2), 7.0), epoch=2)
    state = cache.state_dict()
    assert state["storage"] is None and bool((state["written"] == -1).all())
    restored = AugmentationCache(4, 2)
    restored.load_state_dict(state)
    assert restored.fresh(torch.tensor([3]), epoch=2).tolist() == [False]  # regenerated after a resume


def test_close_releases_the_memory_mapped_store(tmp_path):
    cache = AugmentationCache(6, 2, max_bytes=0, directory=tmp_path)
    cache.put(torch.tensor([1]), torch.zeros(1, 3), epoch=0)
    path = cache.file
    assert path is not None
    cache.close()
    assert not path.exists() and cache.file is None and cache.storage is None
    assert cache.fresh(torch.tensor([1]), epoch=0).tolist() == [False]
    cache.close()  # twice is fine


def test_an_entry_is_reused_only_for_the_label_it_was_solved_for():
    cache = AugmentationCache(4, 3)
    cache.put(torch.tensor([0, 1]), torch.ones(2, 2), epoch=0, labels=torch.tensor([2, 1]))
    assert cache.fresh(torch.tensor([0, 1]), epoch=1, labels=torch.tensor([2, 0])).tolist() == [True, False]


@pytest.mark.parametrize(("kwargs", "match"), [({"every_n_epochs": 0}, "^`every_n_epochs` must"),
                                                ({"every_n_epochs": 2, "max_bytes": -1}, "^`max_bytes` must")])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AugmentationCache(4, **kwargs)


def test_a_cache_larger_than_half_the_gpus_free_memory_stays_in_host_memory(monkeypatch):
    # the check runs before anything is allocated on the GPU, so it is testable without one
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100, 10_000))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    cache = AugmentationCache(10, 2, device="cuda")
    with pytest.warns(UserWarning, match="host memory"):
        cache.put(torch.tensor([1]), torch.ones(1, 4), epoch=0)  # 160 bytes > 100 / 2 free
    assert cache.storage is not None and cache.storage.device.type == "cpu"
    assert torch.equal(cache.get(torch.tensor([1])), torch.ones(1, 4))


def test_a_checkpointed_store_is_saved_in_host_memory_and_restored_on_the_caches_device():
    cache = AugmentationCache(4, 2)
    cache.put(torch.tensor([0, 3]), torch.arange(6.0).view(2, 3), torch.tensor([1, 0]), epoch=0)
    state = cache.state_dict(include_inputs=True)
    assert state["storage"].device.type == "cpu" and state["storage"].data_ptr() != cache.storage.data_ptr()
    restored = AugmentationCache(4, 2, device="cpu")
    restored.load_state_dict(state)
    state["storage"].zero_()  # the restored store is a copy
    assert torch.equal(restored.get(torch.tensor([3])), torch.tensor([[3.0, 4.0, 5.0]]))
    assert restored.fresh(torch.tensor([0, 3]), 1, torch.tensor([1, 1])).tolist() == [True, False]


def test_the_callback_refuses_a_non_bool_cache_on_device():
    from lpa3_lightning import LPA3Callback

    with pytest.raises(ValueError, match="cache.on_device"):
        LPA3Callback(cache={"regenerate_every_n_epochs": 2, "on_device": "gpu"})  # type: ignore[arg-type]


def test_the_memory_mapped_file_is_unlinked_once_mapped(tmp_path):
    """The file's name is removed as soon as it is mapped (the mapping stays usable): a run that
    ends any way, SIGKILL included, leaves no file behind."""
    cache = AugmentationCache(6, 2, max_bytes=0, directory=tmp_path)
    x = torch.randn(2, 3)
    cache.put(torch.tensor([4, 1]), x, epoch=0)
    assert cache.file is not None and list(tmp_path.iterdir()) == []
    assert torch.equal(cache.get(torch.tensor([4, 1])), x)
    cache.put(torch.tensor([4]), torch.zeros(1, 3), epoch=1)  # still written through the mapping
    assert torch.equal(cache.get(torch.tensor([4, 1])), torch.stack([torch.zeros(3), x[1]]))
    cache.close()


def test_a_sigkilled_run_leaves_no_cache_file(tmp_path):
    import subprocess
    import sys

    script = ("import os, signal, torch; from lpa3_lightning.core.cache import AugmentationCache; "
              f"c = AugmentationCache(8, 2, max_bytes=0, directory={str(tmp_path)!r}); "
              "c.put(torch.tensor([0]), torch.ones(1, 4), epoch=0); os.kill(os.getpid(), signal.SIGKILL)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == -9, done.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_a_restored_in_memory_store_larger_than_max_bytes_goes_to_a_file(tmp_path):
    """``cache.max_bytes`` holds for a store restored from a checkpoint too: resumed with a smaller
    bound, the entries move to a memory-mapped file; without a folder, refused by name."""
    cache = AugmentationCache(16, 2)  # 1 GiB: in memory
    x = torch.randn(16, 96)
    cache.put(torch.arange(16), x, epoch=0)
    state = cache.state_dict(include_inputs=True)
    assert state["storage"].numel() * 4 == 6144
    restored = AugmentationCache(16, 2, max_bytes=0, directory=tmp_path)
    restored.load_state_dict(state)
    assert restored.file is not None and restored.fresh(torch.arange(16), epoch=1).all()
    assert torch.equal(restored.get(torch.arange(16)), x)
    fits = AugmentationCache(16, 2, max_bytes=6144)
    fits.load_state_dict(state)
    assert fits.file is None and torch.equal(fits.get(torch.arange(16)), x)
    with pytest.raises(ValueError, match=r"cache\.max_bytes=0.*cache\.dir"):
        AugmentationCache(16, 2, max_bytes=0).load_state_dict(state)


def test_an_unusable_folder_is_refused_by_name(tmp_path):
    (tmp_path / "a_file").write_text("not a folder")
    for folder in (tmp_path / "a_file", tmp_path / "a_file" / "cache"):
        with pytest.raises(ValueError, match="not a folder"):
            AugmentationCache.check_directory(folder, "cache.dir")
    AugmentationCache.check_directory(tmp_path / "new" / "cache", "cache.dir")  # creatable: fine
    assert not (tmp_path / "new").exists()  # (and nothing was created)


def test_a_file_store_travels_in_the_checkpoint_when_asked(tmp_path):
    """``include_inputs`` (``cache.in_checkpoint=True``) snapshots a memory-mapped store too, so a
    resume with a file cache is exact; restored over max_bytes it is a file again."""
    cache = AugmentationCache(6, 2, max_bytes=0, directory=tmp_path / "a")
    x = torch.randn(2, 3)
    cache.put(torch.tensor([5, 1]), x, epoch=0)
    state = cache.state_dict(include_inputs=True)
    assert state["storage"] is not None and torch.equal(state["storage"][torch.tensor([5, 1])], x)
    restored = AugmentationCache(6, 2, max_bytes=0, directory=tmp_path / "b")
    restored.load_state_dict(state)
    assert restored.file is not None and restored.fresh(torch.tensor([5, 1]), epoch=1).all()
    assert torch.equal(restored.get(torch.tensor([5, 1])), x)
    assert cache.state_dict()["storage"] is None  # not asked: the resumed run regenerates them


# ---------------------------------------------------------------- a batch's plan: reuse, solve or wait
T, F = True, False


@pytest.mark.parametrize(("cached", "solver_runs", "keep", "reuse", "solve"), [
    ([F, F, F], T, [T, T, T], [F, F, F], [T, T, T]),  # no cache: every row is solved
    ([T, F, F, T], T, [T, T, T, T], [T, F, F, T], [F, T, T, F]),
    ([T, F, T], T, [T, F, T], [T, F, T], [F, F, F]),  # a lone row to solve waits (solver's batch statistics)
    ([T, F, F], F, [F, F, F], [F, F, F], [F, F, F]),  # solver off and one cached x': a lone x' is not trained
    ([T, T, F], F, [T, T, F], [T, T, F], [F, F, F]),  # solver off: the cached rows only
    ([F], T, [F], [F], [F]),  # one selected row gets nothing
    ([], T, [], [], []),
])
def test_each_row_is_reused_solved_or_left_out(cached, solver_runs, keep, reuse, solve):
    plan = plan_rows(torch.tensor(cached, dtype=torch.bool), solver_runs)
    assert plan.keep.tolist() == keep and plan.reuse.tolist() == reuse and plan.solve.tolist() == solve
    assert not (plan.reuse & plan.solve).any() and torch.equal(plan.reuse | plan.solve, plan.keep)


def test_a_mask_of_another_kind_is_refused():
    with pytest.raises(ValueError, match="1-D bool mask"):
        plan_rows(torch.tensor([1, 0]))


def test_assembled_inputs_take_solved_and_cached_rows_in_place_and_copy_the_rest():
    x = torch.arange(12.0, requires_grad=True).view(4, 3)
    solve, reuse = torch.tensor([T, F, F, T]), torch.tensor([F, T, F, F])
    solved, cached = torch.full((2, 3), -1.0), torch.full((1, 3), -2.0, dtype=torch.float64)
    out = assemble_inputs(x, solve, solved, reuse, cached)
    assert out[[0, 3]].eq(-1).all() and out[1].eq(-2).all() and torch.equal(out[2], x[2].detach())
    assert out.dtype == x.dtype and not out.requires_grad
    assert x[0, 0] == 0  # the batch itself is left alone
