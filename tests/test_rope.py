"""The rope table against transformers' own rope functions (ROPE_INIT_FUNCTIONS), one config each."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.frontend.rope import context_limit, rope_parameters

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VARIANTS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    "yarn_deepseek": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 0.707,
                      "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},
    "yarn_untruncated": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048,
                         "truncate": False},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 4096,
                 "short_factor": list(np.linspace(1.0, 1.3, 32)), "long_factor": list(np.linspace(1.0, 9.0, 32))},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_inverse_frequencies_and_mscale_equal_transformers(name):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    scaling, theta, max_pos = VARIANTS[name], 500000.0, 131072
    config = LlamaConfig(hidden_size=512, num_attention_heads=8, head_dim=64, max_position_embeddings=max_pos,
                         rope_parameters={"rope_theta": theta, **(scaling or {"rope_type": "default"})})
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        want_freq = 1.0 / (theta ** (torch.arange(0, 64, 2, dtype=torch.int64).float() / 64))
        want_mscale = 1.0
    else:
        want_freq, want_mscale = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    freq, mscale = rope_parameters(64, theta, scaling, max_pos)
    assert freq.dtype == np.float32 and freq.shape == (32,)
    np.testing.assert_allclose(freq, want_freq.numpy(), rtol=2e-6, atol=0)
    assert mscale == pytest.approx(want_mscale, rel=1e-12)


def test_longrope_and_dynamic_stop_where_fixed_frequencies_stop_being_exact():
    assert context_limit(VARIANTS["longrope"], 131072) == 4096
    assert context_limit(VARIANTS["yarn"], 131072) == 131072
    assert context_limit(VARIANTS["dynamic"], 8192) == 8192


def test_unknown_rope_type_is_refused_by_name():
    from kiln.errors import KilnError
    with pytest.raises(KilnError, match="'su'"):
        rope_parameters(64, 1e4, {"rope_type": "su"}, 4096)
