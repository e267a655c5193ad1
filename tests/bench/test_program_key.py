"""``program_key``: what makes two compiled programs "the same" for the benchmark's dedupe.

The texts below follow what jax 0.11.2 compiled on an H100 for mosaic_flash's forward, by name
and through ``impl="auto"`` in one process (abridged): the same kernel, named ``entry_0`` and
``entry_1`` by Mosaic GPU's per-process counter, with module hashes and XLA fingerprints that
follow from the name.
"""

from __future__ import annotations

from typing import Any

from jaxattn_bench.timing import program_key

_HLO = (
    'HloModule jit_{fn}, is_scheduled=true, entry_computation_layout={{(bf16[4]{{0}})->bf16[4]{{0}}}}, '
    'frontend_attributes={{fingerprint_before_lhs="{fingerprint}"}}\n\n'
    "FileNames\n1 \"{file}\"\n\n"
    "ENTRY %main (q.1: bf16[4]) -> bf16[4] {{\n"
    '  %q.1 = bf16[4]{{0}} parameter(0), metadata={{op_name="q" stack_frame_id=1}}\n'
    '  ROOT %mpmd_map.3 = bf16[4]{{0}} custom-call(%q.1), custom_call_target="mosaic_gpu_v2", '
    'metadata={{op_name="jit(f)/mpmd_map" stack_frame_id={frame}}}, backend_config={{kernel_hash = "{kernel_hash}", '
    'module = "ML\\EFR\\01{body}\\00mosaic_gpu.dump_basename\\00entry_{n}\\00stable_mosaic_gpu.version\\00entry"}}\n'
    "}}\n"
)


class _Compiled:
    def __init__(self, **fields: Any) -> None:
        base = {"fn": "f", "fingerprint": "22aa57b8", "file": "bench.py", "frame": 9, "body": "wgmma\\00exp2",
                "kernel_hash": "\\02\\F5\\CC:@f\\22", "n": 0}
        self.text = _HLO.format(**{**base, **fields})

    def as_text(self) -> str:
        return self.text


def test_one_kernel_compiled_twice_in_a_process_is_one_program() -> None:
    first = program_key(_Compiled())
    again = program_key(_Compiled(n=1, kernel_hash=">\\F4l\\AE\\\\V", fingerprint="a5c78cfa", frame=10,
                                  fn="g", file="other.py"))
    assert first is not None and first == again


def test_another_kernel_is_another_program() -> None:
    first = program_key(_Compiled())
    assert program_key(_Compiled(body="wgmma\\00exp2\\00iota")) != first  # the kernel's own IR
    assert program_key(_Compiled(n=12, body="wgmma")) != first  # renamed, and different


def test_a_runtime_without_text_is_never_deduplicated() -> None:
    class Empty:
        def as_text(self) -> str:
            return ""

    assert program_key(Empty()) is None
