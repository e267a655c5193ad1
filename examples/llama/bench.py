"""Time the example Llama in one process: training steps and decode tokens/s.

    python3 examples/llama/bench.py                 # tiny, any machine (CPU included)
    python3 examples/llama/bench.py --size h200     # 8 layers, d 2048, GQA 16/4, B4 x T4096, bf16, remat

Training step (forward, backward, SGD update) with attention through ``jaxattn.attention``
(auto), ``jax.nn.dot_product_attention``'s default implementation (what Flax's attention calls)
and, on a GPU, cuDNN through jax.nn; decode tokens/s over a dense cache (``jaxattn.attention``
with ``kv_lengths``) and a paged int8 cache (``jaxattn.paged_attention``). One table each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import Config, DenseCache, Llama, PagedCache, generate, sgd_step

SIZES: dict[str, tuple[Config, int, int, bool]] = {  # config, batch, sequence, remat
    "tiny": (Config(), 2, 64, False),
    "small": (Config(vocab=1024, dim=256, layers=4, heads=8, kv_heads=2, hidden=704), 4, 512, False),
    "h200": (Config(vocab=32_000, dim=2048, layers=8, heads=16, kv_heads=4, hidden=5632, dtype="bfloat16"),
             4, 4096, True),
}


def timed(fn: Callable[[], Any], warmup: int, repeats: int) -> float:
    """Median seconds of ``fn()`` (its result blocked on), after ``warmup`` calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def train_rows(cfg: Config, batch: int, seq: int, remat: bool, warmup: int, repeats: int) -> list[tuple[str, str]]:
    tokens = jax.random.randint(jax.random.key(0), (batch, seq + 1), 0, cfg.vocab)
    contenders = [("jaxattn auto", "jaxattn"), ("jax.nn default", "jax.nn")]
    if jax.default_backend() == "gpu":
        contenders.append(("cuDNN (jax.nn)", "cudnn"))
    rows, base = [], None
    for label, attention in contenders:
        model = Llama(cfg, attention=attention, remat=remat, rngs=nnx.Rngs(0))
        try:
            seconds = timed(lambda m=model: sgd_step(m, tokens, lr=1e-3), warmup, repeats)
        except Exception as err:  # a contender that cannot run here says why, the others still run
            rows.append((label, f"failed: {type(err).__name__}: {str(err).splitlines()[0][:80]}"))
            continue
        base = base or seconds
        rows.append((label, f"{seconds * 1e3:9.1f} ms   {seconds / base:.2f}x jaxattn's time"))
    return rows


def decode_rows(cfg: Config, batch: int, prompt_len: int, steps: int) -> list[tuple[str, str]]:
    model = Llama(cfg, rngs=nnx.Rngs(0))
    prompt = jax.random.randint(jax.random.key(1), (batch, prompt_len), 0, cfg.vocab)
    rows = []
    caches: list[tuple[str, Callable[[], Any]]] = [
        ("dense cache (kv_lengths)", lambda: DenseCache.empty(cfg, batch, prompt_len + steps + 1)),
        ("paged int8 cache", lambda: PagedCache.empty(cfg, batch, prompt_len + steps + 1, page_size=16)),
    ]
    for label, empty in caches:
        jax.block_until_ready(generate(model, prompt, steps, empty()))  # compile: prefill, decode steps
        start = time.perf_counter()
        tokens, _ = generate(model, prompt, steps, empty())
        jax.block_until_ready(tokens)
        seconds = time.perf_counter() - start
        rows.append((label, f"{batch * steps / seconds:9.1f} tokens/s  ({steps} steps, B{batch}, prefill "
                            f"{prompt_len}, prefill included)"))
    return rows


def table(title: str, rows: list[tuple[str, str]]) -> str:
    width = max(len(r[0]) for r in rows)
    return "\n".join([title, *(f"  {name:<{width}}  {value}" for name, value in rows)])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--decode-steps", type=int, default=32)
    args = parser.parse_args(argv)
    cfg, batch, seq, remat = SIZES[args.size]
    device = jax.devices()[0]
    print(f"examples/llama/bench.py --size {args.size}: {cfg.layers} layers, d {cfg.dim}, GQA {cfg.heads}/"
          f"{cfg.kv_heads}, {cfg.dtype}, remat {remat}; {device.platform} ({device.device_kind}), "
          f"jax {jax.__version__}")
    print(table(f"training step, B{batch} x T{seq} (median of {args.repeats})",
                train_rows(cfg, batch, seq, remat, args.warmup, args.repeats)))
    print(table("decode (greedy)", decode_rows(cfg, batch, min(seq, 128), args.decode_steps)))


if __name__ == "__main__":
    main()
