"""examples/llama at a tiny size: it trains (dense and packed documents) and generates through a
dense cache and a paged int8 cache, all through jaxattn."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
from flax import nnx

EXAMPLE = Path(__file__).parents[2] / "examples" / "llama"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"llama_example_{name}", EXAMPLE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


llama = _load("model")
B, T = 4, 17


def batch() -> jnp.ndarray:
    start = np.random.default_rng(0).integers(0, llama.Config().vocab, (B, 1))
    return jnp.asarray((start + 3 * np.arange(T)) % llama.Config().vocab, jnp.int32)  # learnable: +3 each step


def test_packed_positions_restart_per_document() -> None:
    seg = jnp.array([[0, 0, 0, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
    np.testing.assert_array_equal(llama.packed_positions(seg), [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])


def test_it_trains_and_generates_through_jaxattn() -> None:
    cfg = llama.Config()
    model = llama.Llama(cfg, rngs=nnx.Rngs(0))
    tokens = batch()
    dense = [float(llama.sgd_step(model, tokens)) for _ in range(5)]
    assert dense[-1] < dense[0] - 1.0, dense  # dense causal training: the loss falls
    seg = jnp.asarray(np.repeat([[0] * 9 + [1] * 8], B, axis=0), jnp.int32)
    packed = [float(llama.sgd_step(model, tokens, seg)) for _ in range(3)]
    assert packed[-1] < packed[0], packed  # packed documents (segment ids) too

    prompt, steps = tokens[:, :5], 6
    greedy, dense_logits = llama.generate(model, prompt, steps, llama.DenseCache.empty(cfg, B, 16))
    # the dense cache's logits are those of one forward pass over the whole sequence
    full = jnp.concatenate([prompt, greedy], axis=1)
    positions = jnp.broadcast_to(jnp.arange(full.shape[1]), full.shape)
    np.testing.assert_allclose(dense_logits, model(full, positions)[:, 4:-1], atol=1e-4)
    # the paged int8 cache (quantize_kv, ragged prefill, paged decode) on the same tokens
    _, paged_logits = llama.generate(model, prompt, steps, llama.PagedCache.empty(cfg, B, 16), forced=greedy)
    np.testing.assert_allclose(paged_logits, dense_logits, atol=0.1)  # int8's error, |logits| ~ 7
    agree = np.mean(np.argmax(paged_logits, -1) == np.asarray(greedy))
    assert agree >= 0.9, agree
