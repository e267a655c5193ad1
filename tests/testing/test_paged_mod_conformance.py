"""The paged suite's mask_mod test catches the bugs it is for: a backend that ignores the mask_mod,
one that reads keys no query's KV head sees (NaN there), and one that accepts a mask_mod without
declaring it. Its cases' masks are what they say (the draft tree, the documents, the heads)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.backend import AttentionOutput, Feature, PagedCall, PagedProblem
from jaxattn.testing import oracle
from jaxattn.testing.paged_cases import PAGED_MOD_CASES, make_paged_inputs, paged_mask_mod, poison_unread, seen_slots
from jaxattn.testing.paged_conformance import PagedConformanceSuite
from jaxattn_vanilla.paged.impl import PagedReference

CASES = {c.name: c for c in PAGED_MOD_CASES}


class IgnoresMaskMod(PagedReference):
    def forward_native(self, call: PagedCall) -> AttentionOutput:
        return super().forward_native(call.replace(mask_mod=None))


class ReadsUnseenKeys(PagedReference):
    """Right, plus zero times the call without its mask_mod: reads every key below the lengths."""

    def forward_native(self, call: PagedCall) -> AttentionOutput:
        out = super().forward_native(call).attention_outputs
        plain = super().forward_native(call.replace(mask_mod=None)).attention_outputs
        return AttentionOutput(attention_outputs=out + 0.0 * jnp.sum(plain))


class ClaimsNoMaskMod(PagedReference):
    """Accepts a mask_mod without declaring Feature.MASK_MOD."""

    features = PagedReference.features - {Feature.MASK_MOD}

    def not_supported_reasons(self, problem: PagedProblem) -> list[str]:
        return [r for r in super().not_supported_reasons(problem) if "mask_mod" not in r]


def _suite(impl: type[PagedReference]) -> PagedConformanceSuite:
    class Suite(PagedConformanceSuite):
        impl_class = impl

    return Suite()


@pytest.mark.parametrize(("impl", "case"), [
    (IgnoresMaskMod, "mm_tree"),
    (ReadsUnseenKeys, "mm_by_head"),
    (ReadsUnseenKeys, "mm_document_window"),
    (ClaimsNoMaskMod, "mm_tree_uniform"),
])
def test_a_broken_backend_fails(impl: type[PagedReference], case: str) -> None:
    with pytest.raises(AssertionError):
        _suite(impl).test_mask_mod(CASES[case], "float32")


def _visible(name: str) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
    case = CASES[name]
    a = make_paged_inputs(case, "float32")
    return a, oracle.paged_visibility(a["kv_lengths"], a["cu_q_lens"], a["num_seqs"], case.hq,
                                      sliding_window=case.sliding_window, mask_mod=paged_mask_mod(case, a))


def test_the_tree_is_a_tree() -> None:
    """mm_tree's sequence 0: 2 causal queries, then 4 drafts at 12..15 (siblings 12 and 13 under
    the accepted token 11, 14 and 15 children of 12); its decode step sees every key."""
    _, vis = _visible("mm_tree")
    drafts = vis[0][0, 2:, 12:]  # head 0, the drafts over the drafts
    np.testing.assert_array_equal(drafts, [[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]])
    causal = np.arange(16) <= np.asarray([[10], [11]])  # the queries before the drafts, at 10 and 11
    np.testing.assert_array_equal(vis[0][:, :2], np.broadcast_to(causal, (4, 2, 16)))
    assert vis[0][:, 2:, :12].all()  # the drafts see the cache
    assert vis[1].all() and vis[1].shape == (4, 1, 9)


def test_unseen_keys_are_poisoned() -> None:
    """The cases leave keys unseen that the poisoning reaches: per KV head (mm_by_head), and a
    document no query sees, though its page is shared (mm_document_window)."""
    for name, heads in (("mm_by_head", True), ("mm_document_window", False)):
        case = CASES[name]
        a, vis = _visible(name)
        seen = seen_slots(a["page_table"], vis, a["k_pages"].shape[0], case.page_size, case.hkv)
        poisoned = poison_unread(case, a, np.nan, seen=seen)
        clean = poison_unread(case, a, np.nan)
        extra = np.isnan(poisoned["k_pages"]) & ~np.isnan(clean["k_pages"])  # read, but seen by no query
        assert extra.any(), name
        if heads:  # some slot unseen in one KV head, seen in the other
            assert (extra[..., 0, 0] != extra[..., 1, 0]).any()
    # The oracle's answer is the clean cache's: unseen keys are not in it.
    case = CASES["mm_by_head"]
    a, vis = _visible("mm_by_head")
    seen = seen_slots(a["page_table"], vis, a["k_pages"].shape[0], case.page_size, case.hkv)
    kw = {"softmax_aux": a["softmax_aux"], "logits_soft_cap": case.logits_soft_cap, "mask_mod": paged_mask_mod(case, a)}
    p = poison_unread(case, a, 0.0, seen=seen)
    args = ("q", "k_pages", "v_pages", "page_table", "kv_lengths", "cu_q_lens", "num_seqs")
    np.testing.assert_array_equal(oracle.paged_attention(*(p[n] for n in args), **kw),
                                  oracle.paged_attention(*(a[n] for n in args), **kw))
