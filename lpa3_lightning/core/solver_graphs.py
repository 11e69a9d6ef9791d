"""The sync-free solve captured as CUDA graphs, one per padded batch size, and replayed.

On a GPU the eager solver is bound by the host, not by the device: measured on an H200
(ResNet-18, 28x28, batch 128, 5 steps), an LP-A3 step launched about 3,500 kernels and kept the
GPU busy a quarter of the time. A CUDA graph records the kernels of one solve once and replays
them with a single launch (PyTorch, "CUDA Graphs",
https://pytorch.org/docs/stable/notes/cuda.html#cuda-graphs).

A solve can be captured because, with ``lpa3_attack(..., sync_free=True)``, it reads no device
value on the host and dispatches the same operators whatever the data. What a graph cannot
change is a shape or an address, so this module

* pads the rows to a multiple of ``bucket`` (a batch of 37 selected rows runs the graph of 40);
  the padding rows are copies of the first row, every row's output depends on that row alone
  in every solver BatchNorm mode (eval, frozen batch statistics), and the loss's batch
  mean is taken over the real rows (weights 1/n, 0 on padding: the authors' mean scales each
  row's gradient by 1/N before a normalisation that adds 1e-8, so N must not change), so
  padding changes no real row's ``x'``;
* copies each call's inputs (rows, labels, initial noise, input bounds, step bound, frozen batch
  statistics) into buffers that live as long as the graph, and the real rows of the outputs out;
* captures again when a parameter or buffer of the model moved to other memory (a graph reads
  the addresses it was captured with: ``load_state_dict`` copies in place and is fine, ``.to()``
  or replacing a parameter is not), or when a setting, shape or dtype changes.

Without CUDA (``capture=False``, or a CPU tensor) the same padded buffers are solved eagerly,
which is how the padding and the buffers are tested on a CPU.

Measured on an H100 (ResNet-18, 28x28, batch 128, ratio 0.3, 5 steps): the captured solve gave
the eager padded solve's ``x'`` (``tests/test_gpu.py``, deterministic cuDNN), cut the kernel
launches of an LP-A3 step from 3,172 to 1,498 and its steady-state time by half under the
profiler; but every new padded size costs a capture (two eager warm-up solves first), so a
3-epoch run was slower, and the graphs' buffers raised peak memory by a quarter. It is worth it
in long runs; ``LPA3Callback(runtime={"cuda_graphs": False})`` stays the default until a long run is measured.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from torch import Tensor, nn

from lpa3_lightning.core.batch_statistics import BatchStatistics

__all__ = ["SolverGraphs"]

#: The solve's outputs, each with one row (or value) per sample: x', log p(y|x), log p(y|x'),
#: the perceptual distance and whether the final iterate was pulled back.
SolveOutputs = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]
#: Enters the solver's forward mode with the given frozen batch statistics (or None).
SolverContext = Callable[[BatchStatistics | None], contextlib.AbstractContextManager[Any]]


@dataclass
class _Buffers:
    """The fixed-address inputs of one graph and, once captured, the graph and its outputs."""

    x: Tensor
    y: Tensor
    noise: Tensor
    bounds: tuple[Tensor, Tensor] | None
    step_bound: Tensor | float | None
    twin: BatchStatistics | None
    row_weights: Tensor
    graph: Any = None
    outputs: SolveOutputs | None = None

    def fill(self, x: Tensor, y: Tensor, noise: Tensor, bounds: tuple[Tensor, Tensor] | None,
             step_bound: Tensor | float | None, twin: BatchStatistics | None) -> None:
        """Copy one call's values in; rows past ``x``'s repeat its first row (no host read)."""
        n = x.shape[0]
        for buffer, value in ((self.x, x), (self.y, y), (self.noise, noise)):
            buffer[:n].copy_(value)
            buffer[n:].copy_(value[:1].expand_as(buffer[n:]))
        if self.bounds is not None and bounds is not None:
            self.bounds[0].copy_(bounds[0])
            self.bounds[1].copy_(bounds[1])
        if isinstance(self.step_bound, Tensor):
            self.step_bound.copy_(step_bound)  # type: ignore[arg-type]
        # the loss's batch mean over the real rows only (the padding rows weigh 0)
        self.row_weights.fill_(0.0)
        self.row_weights[:n].fill_(1.0 / n)
        if self.twin is not None and twin is not None:
            for static, given in zip(self.twin.values, twin.values):
                if static is not None and given is not None:
                    static[0].copy_(given[0])
                    static[1].copy_(given[1])

    def arguments(self) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor, Tensor] | None, Tensor | float | None, Tensor]:
        return self.x, self.y, self.noise, self.bounds, self.step_bound, self.row_weights


def _clone_or_none(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, Tensor) else value


class SolverGraphs:
    """CUDA graphs of the sync-free solve, keyed by padded batch size, settings and model memory.

    Used through ``lpa3_attack(..., sync_free=True, graphs=SolverGraphs())`` or
    ``LPA3Callback(runtime={"cuda_graphs": True})``; one object per model (it holds the graphs' memory until
    :meth:`reset` or deletion).

    Args:
        bucket: rows are padded to a multiple of this, so a varying number of selected samples
            needs at most ``ceil(batch_size / bucket)`` graphs.
        capture: True captures CUDA graphs (CUDA inputs only), False solves the padded buffers
            eagerly, None (default) captures when the inputs are on a CUDA device.
        warmup: eager solves on a side stream before a capture (cuDNN's algorithm choice and
            lazy initialisation must not happen during a capture).

    Attributes:
        captures: graphs captured so far (a recapture after the model's memory moved counts).
        replays: solves served by replaying a captured graph.

    Raises:
        ValueError: on an argument out of range, naming it and the fix.
    """

    def __init__(self, bucket: int = 8, capture: bool | None = None, warmup: int = 2) -> None:
        for name, value in (("bucket", bucket), ("warmup", warmup)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be an int >= 1, got {value!r}. Fix: use the default "
                                 f"({8 if name == 'bucket' else 2}).")
        if capture not in (True, False, None):
            raise ValueError(f"`capture` must be True, False or None, got {capture!r}. Fix: use None (capture on CUDA).")
        self.bucket, self.capture, self.warmup = bucket, capture, warmup
        self._entries: dict[Hashable, _Buffers] = {}
        self._memory_key: tuple[int, ...] | None = None
        self._pool: Any = None
        self.captures = 0
        self.replays = 0

    def padded_size(self, n: int) -> int:
        """The number of rows the solve of ``n`` rows runs on."""
        return -(-n // self.bucket) * self.bucket

    def reset(self) -> None:
        """Drop every graph and buffer (their GPU memory is freed with the last reference)."""
        self._entries.clear()
        self._memory_key = None
        self._pool = None

    def solve(self, rows: Callable[..., SolveOutputs], x: Tensor, y: Tensor, noise: Tensor,
              bounds: tuple[Tensor, Tensor] | None, step_bound: Tensor | float | None, context: SolverContext,
              bn_statistics: BatchStatistics | None, model: nn.Module, key: Hashable) -> SolveOutputs:
        """Run ``rows`` (the solver's loop) on ``x`` padded to its bucket; the outputs' real rows.

        Args:
            rows: the loop, called as ``rows(x, y, noise, bounds, step_bound, row_weights)`` inside
                ``context``.
            x, y, noise: the rows to solve, their labels and their initial noise.
            bounds: the input box as tensors, or None.
            step_bound: the step bound (a tensor is copied per call; a number is part of the key).
            context: enters the solver's forward mode with the frozen batch statistics it is given.
            bn_statistics: the frozen batch statistics of the real rows (twin and batch mode), else None.
            model: the network (its parameters' and buffers' addresses are checked per call).
            key: everything else the loop bakes in (settings, BN mode, layers).
        """
        n = x.shape[0]
        size = self.padded_size(n)
        capture = x.is_cuda if self.capture is None else self.capture
        if capture and not x.is_cuda:
            raise ValueError("`capture=True` needs CUDA inputs, got a tensor on "
                             f"{x.device}. Fix: use capture=None (capture on CUDA only) or move the model to a GPU.")
        memory = tuple(t.data_ptr() for t in chain(model.parameters(), model.buffers()))
        if memory != self._memory_key:  # a graph would read the old addresses
            self.reset()
            self._memory_key = memory
        bn_layout = None if bn_statistics is None else tuple(
            None if v is None else (tuple(v[0].shape), v[0].dtype) for v in bn_statistics.values)
        full_key = (key, id(model), size, tuple(x.shape[1:]), x.dtype, y.dtype, x.device, capture,
                    None if bounds is None else (tuple(bounds[0].shape), tuple(bounds[1].shape)),
                    step_bound if not isinstance(step_bound, Tensor) else "tensor", bn_layout)
        buffers = self._entries.get(full_key)
        if buffers is None:
            buffers = self._entries[full_key] = self._allocate(x, y, noise, bounds, step_bound, bn_statistics, size)
        buffers.fill(x, y, noise, bounds, step_bound, bn_statistics)
        if not capture:
            with context(buffers.twin):
                outputs = rows(*buffers.arguments())
        elif buffers.graph is None:
            outputs = self._capture(buffers, rows, context, x.device)
        else:
            buffers.graph.replay()
            self.replays += 1
            outputs = buffers.outputs  # type: ignore[assignment]
        # copied out: the next replay overwrites the graph's outputs
        return tuple(o[:n].clone() for o in outputs)  # type: ignore[return-value]

    @staticmethod
    def _allocate(x: Tensor, y: Tensor, noise: Tensor, bounds: tuple[Tensor, Tensor] | None,
                  step_bound: Tensor | float | None, twin: BatchStatistics | None, size: int) -> _Buffers:
        def rows_of(t: Tensor) -> Tensor:
            return t.new_empty((size, *t.shape[1:]))

        return _Buffers(
            x=rows_of(x), y=rows_of(y), noise=rows_of(noise),
            bounds=None if bounds is None else (bounds[0].detach().clone(), bounds[1].detach().clone()),
            step_bound=_clone_or_none(step_bound),
            twin=None if twin is None else BatchStatistics(
                [None if v is None else (v[0].detach().clone(), v[1].detach().clone()) for v in twin.values]),
            row_weights=torch.zeros(size, device=x.device, dtype=x.dtype),
        )

    def _capture(self, buffers: _Buffers, rows: Callable[..., SolveOutputs], context: SolverContext,
                 device: torch.device) -> SolveOutputs:
        # on x's device: torch.cuda.graph records on a stream of the current device
        with torch.cuda.device(device):
            # the warm-up solves resolve the feature layers (a probe forward) and let cuDNN pick
            # its algorithms outside the capture, on a side stream as the CUDA-graph notes prescribe
            side = torch.cuda.Stream(device=device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    with context(buffers.twin):
                        rows(*buffers.arguments())
            torch.cuda.current_stream(device).wait_stream(side)
            if self._pool is None:
                # One memory pool for every bucket's graph. Safe here although the graphs replay
                # in any order: a graph's outputs stay referenced (no later capture takes their
                # memory), and they are copied out right after its own replay, before another runs.
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            try:
                # thread_local: another thread's CUDA call during the capture (a DataLoader's
                # pin-memory thread, a communication watchdog) must not invalidate it
                with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                    with context(buffers.twin):
                        outputs = rows(*buffers.arguments())
            except Exception as exc:
                raise RuntimeError(
                    "The LP-A3 solver could not be captured as a CUDA graph (its forward may read a value on the "
                    "host, copy from the host, or branch on data). Fix: LPA3Callback(runtime={'cuda_graphs': False}), or "
                    "graphs=None in lpa3_attack."
                ) from exc
            buffers.graph, buffers.outputs = graph, outputs
            self.captures += 1
            graph.replay()  # capturing records the kernels without running them
        self.replays += 1
        return outputs
