"""4-bit quality: the quantisers judged against llama.cpp's rules (gguf-py), the per-tensor policy (the LM head
and embedding at q8, llama.cpp's Q4_K_M layers at 8 bits for v and down, --tensor-quant), the refusal of
groups that do not divide a width, and calibration's importances against transformers' own activations."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.errors import KilnError
from kiln.ir.quant import SCHEMES
from kiln.options import CompileOptions


def _weighted_group_error(w, approx, importance, group=32):
    n, k = w.shape
    return (importance.reshape(1, k // group, group) * ((approx - w) ** 2).reshape(n, k // group, group)).sum(-1)


def _trained_like(rng, n, k):
    """Weights with a trained matrix's heavy tails and a few outlier input channels."""
    w = (rng.standard_t(4, (n, k)) * 0.02).astype(np.float32)
    w[:, rng.choice(k, 4, replace=False)] *= 8
    return w


def test_q4_fits_scales_at_least_as_well_as_llama_cpps_q4_0():
    """Every group's error under kiln's q4 (weighted by the importance given, or not) is at most that of
    llama.cpp's Q4_0 rule on the same group, as gguf-py quantises it (bit-exact with ggml-quants.c): the
    Q4_0 levels are among the candidates kiln fits a scale to. Float16 rounding of the fitted scale may
    cost a hair, hence the 1e-3."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize, quantize
    rng = np.random.default_rng(0)
    w = _trained_like(rng, 48, 256)
    q4_0 = dequantize(quantize(w, gguf.GGMLQuantizationType.Q4_0), gguf.GGMLQuantizationType.Q4_0)
    for importance in (np.ones(256, np.float32), rng.uniform(0.01, 10, 256).astype(np.float32)):
        ours = SCHEMES["q4"].dequantize(SCHEMES["q4"].quantize(w, group_size=32, importance=importance), group_size=32)
        mine, theirs = (_weighted_group_error(w, a, importance) for a in (ours, q4_0))
        assert np.all(mine <= theirs * (1 + 1e-3) + 1e-12)
        assert mine.sum() < 0.97 * theirs.sum()


def test_importance_moves_the_error_onto_inputs_that_matter_less():
    """Weighing some inputs 100 times more lowers q4's, q4a's and q4k's error on those inputs (against the
    same scheme unweighted) and lowers the weighted error overall."""
    rng = np.random.default_rng(1)
    w = _trained_like(rng, 64, 256)
    importance = np.ones(256, np.float32)
    loud = rng.choice(256, 32, replace=False)
    importance[loud] = 100
    for name in ("q4", "q4a", "q4k"):
        scheme = SCHEMES[name]
        plain = scheme.dequantize(scheme.quantize(w, group_size=32), group_size=32)
        weighted = scheme.dequantize(scheme.quantize(w, group_size=32, importance=importance), group_size=32)
        assert np.abs(weighted - w)[:, loud].mean() < 0.8 * np.abs(plain - w)[:, loud].mean(), name
        assert (_weighted_group_error(w, weighted, importance).sum()
                < _weighted_group_error(w, plain, importance).sum()), name


def test_weighted_q4a_is_no_worse_than_llama_cpps_q4_1_on_any_group():
    """q4a with importances starts from Q4_1's min/max pair (gguf-py's) and keeps a fitted pair only where
    it lowers the weighted error: no group is worse than Q4_1's (within the float16 rounding of the pair)."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize, quantize
    rng = np.random.default_rng(2)
    w = _trained_like(rng, 40, 256) + rng.uniform(-0.02, 0.02, (40, 1)).astype(np.float32)
    importance = rng.uniform(0.01, 10, 256).astype(np.float32)
    q4_1 = dequantize(quantize(w, gguf.GGMLQuantizationType.Q4_1), gguf.GGMLQuantizationType.Q4_1)
    ours = SCHEMES["q4a"].dequantize(SCHEMES["q4a"].quantize(w, group_size=32, importance=importance), group_size=32)
    mine, theirs = (_weighted_group_error(w, a, importance) for a in (ours, q4_1))
    assert np.all(mine <= theirs * 1.01 + 1e-12) and mine.sum() < theirs.sum()


def test_q4k_fits_better_than_the_min_max_rule_and_is_gguf_q4_k():
    """q4k's parts are a Q4_K file's numbers (gguf-py's dequantiser of the same numbers written as Q4_K
    blocks gives kiln's dequantised weight exactly), and its fitted sub-block scales beat each sub-block's
    plain min/max range (tests/gguf_files.py q4_k_blocks, as the GGUF spec stores it): less squared error
    in all, and no super-block more than a hair worse."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize
    from gguf_files import q4_k_blocks, q4_k_bytes
    rng = np.random.default_rng(2)
    w = _trained_like(rng, 48, 512)
    parts = SCHEMES["q4k"].quantize(w, group_size=32)
    ours = SCHEMES["q4k"].dequantize(parts, group_size=32)
    rows = parts["scale"].T.reshape(48, 2, 20)       # per super-block: (scale, depth) × 8, d's bytes, -dmin's
    levels = np.stack([parts["q"] & 15, parts["q"] >> 4], axis=-1).reshape(48, -1)
    factors = np.ascontiguousarray(rows[..., 16:]).view(np.float16)
    blocks = q4_k_bytes(factors[..., 0], -factors[..., 1], rows[..., 0:16:2], rows[..., 1:16:2], levels)
    np.testing.assert_array_equal(dequantize(blocks, gguf.GGMLQuantizationType.Q4_K), ours)
    theirs = dequantize(q4_k_blocks(w), gguf.GGMLQuantizationType.Q4_K)
    mine, plain = ((((a - w) ** 2).reshape(48, 2, 256)).sum(-1) for a in (ours, theirs))
    assert mine.sum() < 0.92 * plain.sum() and np.all(mine <= 1.05 * plain)
    with pytest.raises(ValueError, match="super-blocks of 256"):
        SCHEMES["q4k"].quantize(w[:, :288], group_size=32)


def test_more_bits_layers_are_llama_cpps_q4_k_m_choice():
    """llama.cpp's use_more_bits(i, n): i < n/8 || i >= 7n/8 || (i - n/8) % 3 == 2, for the layer counts of
    SmolLM2 (30), Llama-3.2-1B (16) and Llama-3.1-8B (32)."""
    from kiln.passes.tensor_classes import more_bits_layers
    assert more_bits_layers(16) == {0, 1, 4, 7, 10, 13, 14, 15}
    assert more_bits_layers(30) == {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29}
    assert more_bits_layers(32) == {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31}


def test_tensor_classes_of_checkpoint_names():
    from kiln.passes.tensor_classes import layer_of, tensor_classes
    assert tensor_classes("model.layers.3.self_attn.q_proj.weight") == ("q", "attention")
    assert tensor_classes("model.layers.3.mlp.shared_experts.down_proj.weight") == ("down", "mlp")
    assert tensor_classes("model.layers.3.mlp.experts.gate_up") == ("experts",)
    assert tensor_classes("model.layers.0.self_attn.kv_b_proj.weight") == ("attention",)
    assert layer_of("model.layers.12.mlp.up_proj.weight") == 12 and layer_of("lm_head.weight") is None


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory):
    """A tiny Llama of 8 layers (so that some are more-bits layers: 0, 3, 6, 7), 192 wide (no multiple of 128)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from kiln.testing.tiny import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("deep") / "model", "llama", num_hidden_layers=8, hidden_size=192)


def _planned(model_dir, **options):
    """The model's graph after the CPU pipeline with `options`: linear/embed weight -> (format, node)."""
    from kiln.frontend import load_hf_model
    from kiln.ir import input_of, weight_format
    from kiln.passes import run_pipeline
    model = load_hf_model(model_dir)
    graph, _ = run_pipeline(model.build_graph("float32", 16), "cpu", options=CompileOptions(**options))
    weights = {}
    for node in graph.nodes:
        if node.op in ("linear", "embed"):
            name = input_of(node, "weight" if node.op == "linear" else "table")
            param = graph.params[name]
            source = (param.recipe or {}).get("of", name)
            weights[source] = (weight_format(node), node)
    return graph, weights


def test_q4_policy_keeps_head_table_and_q4_k_m_layers_at_8_bits(deep_model):
    """--quant q4 by default: the LM head and the embedding table q8; v (in the fused qkv) and down q8 in
    llama.cpp's more-bits layers; every other linear q4. --tensor-quant overrides each of these."""
    from kiln.passes.tensor_classes import more_bits_layers
    graph, weights = _planned(deep_model, quant="q4")
    more = more_bits_layers(8)
    assert more == {0, 3, 6, 7}
    assert weights["model.embed_tokens.weight"][0] == "q8"
    for name, (fmt, node) in weights.items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if layer is None:
            continue
        want = "q8" if layer in more and ("qkv_proj" in name or "down_proj" in name) else "q4"
        assert fmt == want, (name, fmt)
    heads = [fmt for name, (fmt, node) in weights.items() if node.output == "logits" or "lm_head" in name]
    assert heads and set(heads) == {"q8"}

    _, weights = _planned(deep_model, quant="q4", tensor_classes=(("down", "q4"), ("v", "q4"), ("lm_head", "q4"),
                                                                  ("embedding", "none"), ("o", "none")))
    formats = {fmt for name, (fmt, _) in weights.items() if name.startswith("model.layers.") and "o_proj" not in name}
    assert formats == {"q4"}
    assert all(fmt == "none" for name, (fmt, _) in weights.items() if "o_proj" in name)
    assert "model.embed_tokens.weight" not in {n for n, (f, _) in weights.items() if f != "none"}


def test_q4k_takes_q4a_where_its_super_blocks_do_not_divide(deep_model):
    """--quant q4k on a 192-wide model: the linears reading 192 inputs (q, k, v, gate, up) are q4a, as
    llama.cpp gives a Q4_K tensor of such a width another type; o (8 heads of 32: 256 inputs) and down
    (512) q4k; the head, the table and the more-bits layers' v and down q8, as under q4."""
    from kiln.passes.tensor_classes import more_bits_layers
    _, weights = _planned(deep_model, quant="q4k")
    more = more_bits_layers(8)
    for name, (fmt, node) in weights.items():
        if not name.startswith("model.layers."):
            assert fmt == "q8", (name, fmt)
            continue
        layer = int(name.split(".")[2])
        want = ("q8" if layer in more and ("qkv_proj" in name or "down_proj" in name)
                else "q4k" if "down_proj" in name or "o_proj" in name else "q4a")
        assert fmt == want, (name, fmt)


def test_fused_weight_takes_its_finest_part(deep_model):
    """--tensor-quant k=q8 under q4: the fused qkv of every layer is q8 (no part is stored coarser than asked)."""
    _, weights = _planned(deep_model, quant="q4", tensor_classes=(("k", "q8"),))
    qkv = [fmt for name, (fmt, _) in weights.items() if "qkv_proj" in name]
    assert len(qkv) == 8 and set(qkv) == {"q8"}


def test_groups_that_do_not_divide_a_width_are_refused_by_name(deep_model):
    """A width the group size does not divide is an error naming the weight and the way out, not a silent
    float; the way out it names works."""
    from kiln.frontend import load_hf_model
    from kiln.passes import run_pipeline
    from kiln.passes.quantize import Quantize
    model = load_hf_model(deep_model)
    graph = model.build_graph("float32", 16)
    with pytest.raises(KilnError, match=r"cannot hold model\.layers\.\d+\..*not a multiple of 128 .*--tensor-quant"):
        run_pipeline(graph, "cpu", passes=[Quantize("q4", group_size=128)])
    ok = Quantize("q4", group_size=128, class_modes=(("attention", "q8"), ("mlp", "q8")), lm_head=False)
    run_pipeline(model.build_graph("float32", 16), "cpu", passes=[ok])


def test_bad_tensor_quant_options_are_refused():
    with pytest.raises(KilnError, match="bogus is not one of"):
        CompileOptions(quant="q4", tensor_classes=(("bogus", "q8"),))
    with pytest.raises(KilnError, match="q5 is not one of"):
        CompileOptions(quant="q4", tensor_classes=(("down", "q5"),))
    with pytest.raises(KilnError, match="embedding lookup reads"):
        CompileOptions(quant="q4", tensor_classes=(("embedding", "q4a"),))
    with pytest.raises(KilnError, match="--calibrate needs --quant"):
        CompileOptions(calibrate="text.txt")


def test_calibration_importances_are_transformers_activations(make_model, tmp_path):
    """Each linear's importance is the mean square of its inputs, as transformers computes them on the same
    tokens (forward hooks on the float32 model), scaled to mean 1; its int8 activations' error is the
    relative change of its output when the inputs are rounded in blocks of 32, computed likewise."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from kiln.calibrate import input_importance
    from kiln.frontend import load_hf_model
    model_dir = make_model("llama")
    rng = np.random.default_rng(3)
    chunks = [rng.integers(3, 400, n).tolist() for n in (40, 23, 31, 17, 29)]     # two steps of sequences
    ours, act_errors = input_importance(load_hf_model(model_dir), chunks, 16, activation_block=32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    sums, counts, errors = {}, {}, {}

    def int8_rounded(x, block=32):       # each row's blocks: rint(x · 127 / peak) · peak / 127
        blocks = x.reshape(x.shape[0], -1, block)
        peak = blocks.abs().amax(-1, keepdim=True)
        levels = torch.where(peak > 0, torch.round(blocks * (127 / peak)), torch.zeros_like(blocks))
        return (levels * (peak / 127)).reshape(x.shape)

    def hook(name):
        def record(module, args, out):
            x = args[0].reshape(-1, args[0].shape[-1])
            sums[name] = sums.get(name, 0) + (x.double() ** 2).sum(0)
            counts[name] = counts.get(name, 0) + x.shape[0]
            w = module.weight.double()
            exact, error = x.double() @ w.T, (x - int8_rounded(x)).double() @ w.T
            errors[name] = errors.get(name, 0) + torch.stack([(error ** 2).sum(), (exact ** 2).sum()])
        return record
    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(hook(f"{name}.weight"))
    with torch.no_grad():
        for ids in chunks:
            hf(torch.tensor([ids]))
    theirs = {name: (total / counts[name]).numpy() for name, total in sums.items()}
    theirs = {name: np.maximum(v / v.mean(), 1e-4) for name, v in theirs.items()}
    assert set(ours) == set(theirs)                   # the LM head too: calibration returns every row
    for name, values in ours.items():
        np.testing.assert_allclose(values, theirs[name], rtol=2e-4, err_msg=name)
    # int8 activations' relative output error, every row measured (each step has fewer than SAMPLE_ROWS)
    assert set(act_errors) == set(theirs) and min(act_errors.values()) > 1e-3
    for name, (err, total) in errors.items():
        assert act_errors[name] == pytest.approx(float(np.sqrt(err / total)), rel=2e-3), name
