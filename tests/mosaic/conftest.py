"""The ``mosaic_interpreter`` fixture: jaxattn-mosaic's kernels run on a CPU in jax's Mosaic GPU
interpreter (``tests/mosaic/test_interpret.py``).

The interpreter runs a kernel's warpgroups as threads over simulated global and shared memory,
with its barriers, TMA copies and a happens-before race detector; what it lacks, the fixture
stands in for, in the kernel modules' namespaces only, for the test's duration:

* wgmma and its accumulators (``plgpu.ACC``, ``pl.run_state`` of one, the transposed operand
  ``blocks.transposed``): each accumulator a traced float32 value, each wgmma ``acc + a @ b``
  (float32 products of the 16-bit operands, as the tensor cores);
* register layouts (``plgpu.layout_cast``, ``broadcasted_iota``'s, ``plgpu.load`` of a vector
  into one) and ``set_max_registers``: plain values, plain ``iota``, a plain read;
* its check that a thread waiting on a barrier observed every phase: a producer never waits for
  its ring's last "free" phases, which nothing follows (hardware has no such rule).

Reads past a global array's end come back zero, as TMA fills them (the forward's last key block
past S relies on it). So the schedule, the synchronisation, the tile lists, the masks and the
softmax are the kernels' own; the layouts and the tensor-core instructions are what the
lowering tests (``test_lowering.py``) and the GPU tests check.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax import lax


@dataclasses.dataclass
class _Acc:
    """A wgmma accumulator as a traced value (the scoped functions are traced straight through)."""

    value: Any

    def __getitem__(self, idx: Any) -> Any:
        return self.value

    def __setitem__(self, idx: Any, value: Any) -> None:
        self.value = value


@dataclasses.dataclass(frozen=True)
class _Transposed:
    ref: Any


def _operand(x: Any) -> Any:
    if isinstance(x, _Transposed):
        return _operand(x.ref).T
    if isinstance(x, _Acc):
        return x.value
    return x if isinstance(x, jax.Array) or not hasattr(x, "at") else x[...]


@pytest.fixture
def mosaic_interpreter(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], Any]]:
    """A function returning the interpreter's context (its race detector on); tests assert no race."""
    try:
        from jax._src.pallas.mosaic_gpu.core import WGMMAAccumulatorRef
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, params, shared_memory
    except ImportError as err:
        pytest.skip(f"this jax has no Mosaic GPU interpreter: {err}")
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from jaxattn_mosaic import backward_kernel, blocks, kernel

    @dataclasses.dataclass(frozen=True)
    class Acc:
        shape: tuple[int, ...]
        dtype: Any = jnp.float32

        @staticmethod
        def init(array: Any) -> Any:
            return WGMMAAccumulatorRef(array.shape, array.dtype, _init=array)

    def wgmma(acc: _Acc, a: Any, b: Any) -> None:
        acc.value = acc.value + jnp.dot(_operand(a), _operand(b), preferred_element_type=jnp.float32)

    def run_scoped(f: Any, *types: Any, **kw: Any) -> Any:
        if types and all(isinstance(t, Acc) for t in types):
            return f(*[_Acc(jnp.zeros(t.shape, t.dtype)) for t in types])
        return pl.run_scoped(f, *types, **kw)

    def run_state(f: Any) -> Any:
        def run(init: Any) -> Any:
            leaves, tree = jax.tree.flatten(init, is_leaf=lambda x: isinstance(x, WGMMAAccumulatorRef))
            accs = [_Acc(a._init if isinstance(a, WGMMAAccumulatorRef) else a) for a in leaves]
            f(jax.tree.unflatten(tree, accs))
            return jax.tree.unflatten(tree, [a.value for a in accs])

        return run

    class Pallas:
        def __getattr__(self, name: str) -> Any:
            return {"run_state": run_state, "run_scoped": run_scoped}.get(name) or getattr(pl, name)

    stand_ins = {
        "ACC": Acc,
        "wgmma": wgmma,
        "wgmma_accumulator_load": lambda acc, wait_n=0: acc.value,
        "layout_cast": lambda x, layout: x,
        "broadcasted_iota": lambda dtype, shape, dim, layout=None: lax.broadcasted_iota(dtype, shape, dim),
        "set_max_registers": lambda *args, **kwargs: None,
    }

    class MosaicGpu:
        def __getattr__(self, name: str) -> Any:
            return stand_ins.get(name) or getattr(plgpu, name)

    for module in (kernel, backward_kernel, blocks):
        monkeypatch.setattr(module, "plgpu", MosaicGpu())
    for module in (kernel, backward_kernel):
        monkeypatch.setattr(module, "pl", Pallas())
        monkeypatch.setattr(module, "load_vector", lambda ref, layout: ref[...])
        monkeypatch.setattr(module, "transposed", _Transposed)

    def deallocate(self: Any) -> None:
        with self.cv:
            self.ref_count -= 1

    if not hasattr(shared_memory.Barrier, "deallocate") or not hasattr(gpu_callbacks, "RaceDetectionState"):
        pytest.skip("this jax's Mosaic GPU interpreter is not the one the stand-ins were written for")
    monkeypatch.setattr(shared_memory.Barrier, "deallocate", deallocate)
    races: list[str] = []

    class Races(gpu_callbacks.RaceDetectionState):  # type: ignore[misc,name-defined]
        """Each kernel's detector (one a kernel) records the races it finds here."""

        def __setattr__(self, name: str, value: Any) -> None:
            if name == "races_found" and value:
                races.append("race")
            super().__setattr__(name, value)

    monkeypatch.setattr(gpu_callbacks, "RaceDetectionState", Races)

    def interpreter() -> Any:
        return params.force_gpu_interpret_mode(params.InterpretGPUParams(
            detect_races=True, out_of_bounds_reads="uninitialized_value", uninitialized_memory="zero"))

    yield interpreter
    assert not races, "the Mosaic GPU interpreter found a data race (its message is in the captured output)"
