"""moe_router against transformers' own routers (issue 13): the same router logits in, the same
experts and weights out, for every routing family."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.ir import GraphBuilder, IRError, interpret, verify

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

HIDDEN, TOKENS = 32, 24


def router(module_path: str, config_class: str, **fields):
    """transformers' router module for a small config, with random weights (and bias, where it has one)."""
    import importlib
    cls = getattr(importlib.import_module(f"transformers.models.{module_path.rsplit('.', 1)[0]}"),
                  module_path.rsplit(".", 1)[1])
    module = cls(getattr(transformers, config_class)(hidden_size=HIDDEN, **fields)).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        module.weight.copy_(torch.randn(module.weight.shape, generator=generator))
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.copy_(torch.randn(module.weight.shape[0], generator=generator) * 0.1)
    return module


def dense(weights, indices, experts) -> np.ndarray:
    out = np.zeros((weights.shape[0], experts), np.float32)
    np.put_along_axis(out, indices.numpy(), weights.float().numpy(), axis=-1)
    return out


def kiln_routing(logits: np.ndarray, bias=None, **attrs) -> np.ndarray:
    b = GraphBuilder("router")
    x = b.input("logits", ("tokens", logits.shape[1]), "float32")
    extra = [b.input("bias", (logits.shape[1],), "float32")] if bias is not None else []
    graph = verify(b.output(b.op("moe_router", x, *extra, name="w", **attrs)))
    return interpret(graph, {"logits": logits, **({"bias": bias} if bias is not None else {})}, lambda n: None)["w"]


CASES = {
    "mixtral": (("mixtral.modeling_mixtral.MixtralTopKRouter", "MixtralConfig",
                 dict(num_local_experts=8, num_experts_per_tok=2)),
                dict(scheme="softmax_topk", top_k=2, normalize=True)),
    "qwen2_moe-normalised": (("qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter", "Qwen2MoeConfig",
                              dict(num_experts=8, num_experts_per_tok=3, norm_topk_prob=True)),
                             dict(scheme="softmax_topk", top_k=3, normalize=True)),
    "qwen2_moe-raw": (("qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter", "Qwen2MoeConfig",
                       dict(num_experts=8, num_experts_per_tok=3, norm_topk_prob=False)),
                      dict(scheme="softmax_topk", top_k=3, normalize=False)),
    "granite_moe": (("granitemoe.modeling_granitemoe.GraniteMoeTopKRouter", "GraniteMoeConfig",
                     dict(num_local_experts=8, num_experts_per_tok=2)),
                    dict(scheme="topk_softmax", top_k=2)),
    "deepseek_v2-greedy": (("deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter", "DeepseekV2Config",
                            dict(n_routed_experts=16, num_experts_per_tok=3, topk_method="greedy",
                                 routed_scaling_factor=2.5)),
                           dict(scheme="softmax_topk", top_k=3, scaling=2.5)),
    "deepseek_v2-group-limited": (("deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter", "DeepseekV2Config",
                                   dict(n_routed_experts=16, num_experts_per_tok=3, topk_method="group_limited_greedy",
                                        n_group=4, topk_group=2, routed_scaling_factor=2.5)),
                                  dict(scheme="softmax_group_max", top_k=3, scaling=2.5, n_group=4, topk_group=2)),
    "deepseek_v3": (("deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter", "DeepseekV3Config",
                     dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                          norm_topk_prob=True, routed_scaling_factor=2.5)),
                    dict(scheme="sigmoid_group_top2", top_k=4, normalize=True, scaling=2.5, n_group=4, topk_group=2)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_routing_equals_transformers(case):
    (module_path, config_class, fields), attrs = CASES[case]
    module = router(module_path, config_class, **fields)
    hidden = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, weights, indices = module(hidden)
    experts = module.weight.shape[0]
    bias = module.e_score_correction_bias.numpy().astype(np.float32) if hasattr(module, "e_score_correction_bias") \
        else None
    got = kiln_routing(logits.float().numpy(), bias, **attrs)
    want = dense(weights, indices, experts)
    np.testing.assert_array_equal(got > 0, want > 0)                   # the same experts
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)         # with the same weights
    assert (np.count_nonzero(got, axis=1) == attrs["top_k"]).all()


def test_deepseek_v3_chooses_with_the_bias_but_weighs_without_it():
    """A large bias on one expert makes every token choose it; its weight stays its own score."""
    logits = np.random.default_rng(3).standard_normal((5, 8)).astype(np.float32)
    bias = np.zeros(8, np.float32)
    bias[6] = 10.0
    got = kiln_routing(logits, bias, scheme="sigmoid_group_top2", top_k=2, n_group=1, topk_group=1)
    np.testing.assert_allclose(got[:, 6], 1 / (1 + np.exp(-logits[:, 6])), rtol=1e-6)


@pytest.mark.parametrize("attrs,words", [
    (dict(scheme="softmax_top", top_k=2), "scheme must be one of"),
    (dict(scheme="softmax_topk", top_k=9), "top_k 9"),
    (dict(scheme="softmax_group_max", top_k=2, n_group=3), "do not split into 3 groups"),
    (dict(scheme="sigmoid_group_top2", top_k=2), "takes the score-correction bias"),
])
def test_malformed_routers_are_refused(attrs, words):
    with pytest.raises(IRError, match=words):
        kiln_routing(np.zeros((2, 8), np.float32), **attrs)
