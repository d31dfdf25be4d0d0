"""LoRA adapters: PEFT's files read as PEFT wrote them (safetensors and .bin), the add_lora pass, and
a step mixing 4 adapters and the base model through the interpreter against transformers + peft,
each row against its own adapter; adapters that do not fit are refused by name."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from kiln.options import CompileOptions  # noqa: E402

# (rank, alpha, target modules, rsLoRA): every projection kind, fused and not, ranks below the slots'
ADAPTERS = [(8, 16, ["q_proj", "v_proj"], False), (16, 8, ["k_proj", "o_proj", "down_proj"], False),
            (4, 32, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
            (12, 12, ["gate_proj", "up_proj"], False)]


def make_adapter(model_dir, out, seed: int, rank: int, alpha: float, targets, rslora=False, safe=True):
    """A PEFT LoRA adapter of the model with random A and B (every adapter changes the output)."""
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                             init_lora_weights=False, lora_dropout=0.0)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():           # B at a size that moves the logits without swamping the model
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.2)
    model.save_pretrained(out, safe_serialization=safe)
    return out


@pytest.fixture(scope="module")
def adapters(make_model, tmp_path_factory):
    model_dir = make_model("llama")
    root = tmp_path_factory.mktemp("adapters")
    return model_dir, [make_adapter(model_dir, root / f"a{i}", 10 + i, *spec) for i, spec in enumerate(ADAPTERS)]


def peft_logits(model_dir, adapter_dir, ids) -> np.ndarray:
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    model = peft.PeftModel.from_pretrained(base, adapter_dir).eval() if adapter_dir else base
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].numpy()


def test_adapters_are_read_as_peft_saved_them(adapters, tmp_path):
    """Each module's A and B are PEFT's tensors, its scale alpha / r (rsLoRA: alpha / √r); a .bin save
    reads the same as the safetensors one."""
    from kiln.runtime.lora import read_adapter
    model_dir, folders = adapters
    for folder, (rank, alpha, targets, rslora) in zip(folders, ADAPTERS):
        adapter = read_adapter(folder)
        assert {m.rsplit(".", 1)[1] for m in adapter.modules} == set(targets) and adapter.rank == rank
        a, b, scale = next(pair for m, pair in adapter.modules.items() if m.endswith(targets[0]))
        assert a.shape[0] == rank and b.shape[1] == rank
        assert scale == pytest.approx(alpha / rank ** 0.5 if rslora else alpha / rank)
    binary = make_adapter(model_dir, tmp_path / "bin", 10, *ADAPTERS[0], safe=False)
    assert (binary / "adapter_model.bin").exists() and not (binary / "adapter_model.safetensors").exists()
    from_bin, from_st = read_adapter(binary), read_adapter(folders[0])
    assert from_bin.modules.keys() == from_st.modules.keys()
    for module, (a, b, scale) in from_st.modules.items():
        np.testing.assert_array_equal(from_bin.modules[module][0], a)
        np.testing.assert_array_equal(from_bin.modules[module][1], b)


def _lora_graph(model, max_loras=4, max_rank=16):
    from kiln.passes import run_pipeline
    from kiln.passes.add_lora import lora_layout
    graph, records = run_pipeline(model.build_graph("float32", 16), "cpu",
                                  options=CompileOptions(max_loras=max_loras, max_lora_rank=max_rank))
    assert "add_lora" in [r.name for r in records]
    return graph, lora_layout(graph)


def test_add_lora_puts_one_lora_after_each_projection(make_model):
    """Fused qkv and gate/up get one lora each with their parts' rows, o and down theirs; the LM head none."""
    from kiln.frontend import load_hf_model
    model = load_hf_model(make_model("qwen2"))
    graph, layout = _lora_graph(model)
    c = model.config
    assert len(layout.sites) == 4 * c.num_layers and layout.max_loras == 4 and layout.max_rank == 16
    qkv = next(s for s in layout.sites if s.modules[0].endswith("q_proj"))
    assert [m.rsplit(".", 1)[1] for m in qkv.modules] == ["q_proj", "k_proj", "v_proj"]
    assert qkv.rows == (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim)
    assert graph.inputs[qkv.a].shape == (4, 48, c.hidden_size) and graph.inputs[qkv.b].shape == (4, 16, sum(qkv.rows))
    gate_up = next(s for s in layout.sites if s.modules[0].endswith("gate_proj"))
    assert gate_up.rows == (c.intermediate_size, c.intermediate_size)
    assert not any("lm_head" in m or "embed" in m for s in layout.sites for m in s.modules)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_a_step_mixing_four_adapters_and_the_base_model_is_peft_row_by_row(adapters, make_model, family,
                                                                           tmp_path):
    """One prefill step of five sequences, four on adapters in slots 3, 0, 2, 1 and one on none: each
    sequence's last logits equal transformers + peft with its adapter (the base model's without), so
    rows do not leak into each other's adapters (Qwen2: the fused qkv carries biases)."""
    from paging import make_kv_pages, make_step_inputs
    from kiln.frontend import load_hf_model
    from kiln.interface import LORA_SLOTS
    from kiln.ir import interpret, weight_loader
    from kiln.runtime.lora import read_adapter, slot_rows
    model_dir, folders = adapters
    if family != "llama":
        model_dir = make_model(family)
        folders = [make_adapter(model_dir, tmp_path / f"a{i}", 30 + i, *spec) for i, spec in enumerate(ADAPTERS)]
    model = load_hf_model(model_dir)
    graph, layout = _lora_graph(model)
    slot_of = [3, 0, 2, 1, -1]                        # sequence i's adapter i in a shuffled slot; the last: none
    stacks = {name: np.zeros(graph.inputs[name].shape, np.float32) for s in layout.sites for name in (s.a, s.b)}
    for i, folder in enumerate(folders):
        for name, rows in slot_rows(read_adapter(folder), layout).items():
            stacks[name][slot_of[i]] = rows
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 400, n).tolist() for n in (9, 14, 5, 11, 7)]
    step = make_step_inputs([(ids, 0, [i]) for i, ids in enumerate(prompts)], 16)
    slots = np.concatenate([np.full(len(ids), s, np.int32) for ids, s in zip(prompts, slot_of)])
    c = model.config
    pages = make_kv_pages(c.num_layers, len(prompts), c.num_kv_heads, 16, c.head_dim)
    logits = interpret(graph, {**step, **pages, **stacks, LORA_SLOTS: slots},
                       weight_loader(graph, lambda n: model.weight(n, "float32")))["logits"]
    for i, ids in enumerate(prompts):
        want = peft_logits(model_dir, folders[i] if i < len(folders) else None, ids)
        np.testing.assert_allclose(logits[i], want, rtol=1e-4, atol=1e-4 * np.abs(want).max(), err_msg=f"seq {i}")
    base = peft_logits(model_dir, None, prompts[0])
    assert np.abs(peft_logits(model_dir, folders[0], prompts[0]) - base).max() > 0.05 * np.abs(base).max()


def test_adapters_that_do_not_fit_are_refused_by_name(adapters, tmp_path):
    from kiln.frontend import load_hf_model
    from kiln.runtime.lora import LoRAError, check_adapter, read_adapter
    model_dir, folders = adapters
    _, layout = _lora_graph(load_hf_model(model_dir), max_rank=8)
    check_adapter(read_adapter(folders[0]), layout)                      # rank 8: fits
    with pytest.raises(LoRAError, match="rank 16, over the artifact's --max-lora-rank 8"):
        check_adapter(read_adapter(folders[1]), layout)
    with pytest.raises(LoRAError, match="no adapter slots"):
        check_adapter(read_adapter(folders[0]), None)
    from safetensors.numpy import save_file
    other = tmp_path / "narrower"                    # q_proj of a model 128 wide
    other.mkdir()
    (other / "adapter_config.json").write_text((folders[0] / "adapter_config.json").read_text())
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    save_file({key.format("A"): np.ones((8, 128), np.float32), key.format("B"): np.ones((128, 8), np.float32)},
              str(other / "adapter_model.safetensors"))
    with pytest.raises(LoRAError, match=r"q_proj is \[128 x 128\], the model's is \[256 x 256\]: an adapter of "
                                        "another base model"):
        check_adapter(read_adapter(other), layout)
    head = make_adapter(model_dir, tmp_path / "head", 1, 4, 8, ["q_proj", "lm_head"])   # PEFT saves the table too
    with pytest.raises(LoRAError, match="lm_head.base_layer.weight is not a LoRA A or B weight"):
        read_adapter(head)
    table = tmp_path / "table"
    table.mkdir()
    (table / "adapter_config.json").write_text((folders[0] / "adapter_config.json").read_text())
    key = "base_model.model.model.embed_tokens.lora_{}.weight"
    save_file({key.format("A"): np.ones((8, 512), np.float32), key.format("B"): np.ones((256, 8), np.float32)},
              str(table / "adapter_model.safetensors"))
    with pytest.raises(LoRAError, match="model.embed_tokens are not projections this artifact gives adapters"):
        check_adapter(read_adapter(table), layout)
    with pytest.raises(LoRAError, match="cannot read .*adapter_config.json"):
        read_adapter(tmp_path / "missing")
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((folders[0] / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(LoRAError, match="DoRA"):
        read_adapter(dora)
    (dora / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(LoRAError, match="no adapter_model.safetensors or adapter_model.bin"):
        read_adapter(dora)


@pytest.mark.build
def test_the_compiled_model_runs_four_adapters_and_the_base_in_one_batch(adapters):
    """kiln.LLM on a CPU artifact with 4 slots: one generate over 4 adapters and the base model gives each
    prompt transformers + peft's greedy tokens with its adapter, unmerged and merged (merge_and_unload);
    seeded sampling gives each request in the mixed batch the tokens it gets alone; inspect names the slots."""
    from artifact_cache import cpu_artifact
    from reference import hf_greedy, random_prompt
    from kiln.inspect import summary
    from kiln.runtime.llm import LLM
    from kiln.runtime.lora import LoRARequest
    from kiln.runtime.sampler import SamplingParams
    model_dir, folders = adapters
    artifact = cpu_artifact(model_dir, max_loras=4, max_lora_rank=16)
    assert "lora       4 adapter slots of rank up to 16" in summary(artifact)
    llm = LLM(artifact, kv_memory="16MiB")
    prompts = [random_prompt(6 + 3 * i, 70 + i) for i in range(5)]
    loras = [LoRARequest(f"a{i}", i + 1, str(folder)) for i, folder in enumerate(folders)] + [None]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False, lora_request=loras)]
    for ids, lora, tokens in zip(prompts, loras, got):
        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
        model = peft.PeftModel.from_pretrained(base, lora.lora_path).eval() if lora else base
        assert tokens == hf_greedy(model, ids, 8), lora
        if lora:
            assert tokens == hf_greedy(model.merge_and_unload(), ids, 8), lora
    assert len({tuple(t) for t in got}) == len(got)            # every adapter changed the tokens
    seeded = [SamplingParams(temperature=0.9, max_tokens=8, seed=100 + i, ignore_eos=True) for i in range(5)]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, seeded, use_tqdm=False, lora_request=loras)]
    alone = [llm.generate([p], [sp], use_tqdm=False, lora_request=[lora])[0].outputs[0].token_ids
             for p, sp, lora in zip(prompts, seeded, loras)]
    assert together == alone


@pytest.mark.build
def test_a_q8_artifact_keeps_bfloat16_adapters_close_to_peft(adapters):
    """Beside q8 weights the slots are bfloat16 (half the bytes a step of many adapters reads): an adapter's
    last logits stay as close to transformers + peft's (float32) as q8 holds the base model's."""
    from artifact_cache import cpu_artifact
    from paging import make_step_inputs
    from reference import random_prompt
    from kiln.artifact import read_manifest
    from kiln.interface import LORA_SLOTS
    from kiln.runtime.lora import read_adapter, slot_rows
    from kiln.runtime.model import CompiledModel
    model_dir, folders = adapters
    artifact = cpu_artifact(model_dir, quant="q8", quant_embedding=False, max_loras=2, max_lora_rank=16)
    assert read_manifest(artifact).lora.dtype == "bfloat16"
    compiled = CompiledModel(artifact)
    compiled.allocate_kv(16 * compiled.bytes_per_page)
    compiled.write_lora_slot(1, slot_rows(read_adapter(folders[2]), compiled.lora))
    for seed in range(3):
        ids = random_prompt(12 + seed, 90 + seed)
        step = make_step_inputs([(ids, 0, [0])], compiled.page_size)
        got = compiled.forward({**step, LORA_SLOTS: np.full(len(ids), 1, np.int32)})[0]
        want = peft_logits(model_dir, folders[2], ids)
        assert got @ want / np.linalg.norm(got) / np.linalg.norm(want) >= 0.999
