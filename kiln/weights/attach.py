"""`kiln attach-weights`: a checkpoint's weights written into an artifact compiled with `--no-weights`.

Compiling and converting weights are separate jobs: the library is compiled where TVM's compiler
is, and the weights are made where the checkpoint is (a GPU machine that has only TVM's runtime,
or a machine a multi-GB file cannot be sent to). compile records everything its passes were
planned from (target, dtype, page size, quantisation, the MLA prefill threshold, the passes that
ran), so the same passes run here on the checkpoint and give the same params; each stored weight
is then read, fused, quantised and laid out exactly as compile does (convert.write_weights), and
the file has the bytes compile would have written.

The checkpoint must have the config the artifact was compiled from (kiln's reading of it: the
names of the differing fields are given otherwise), and every weight the manifest lists must come
out of the passes with its recorded shape. Weights from a checkpoint are never replaced, and
generated ones (`kiln fill-weights`) only with `force`.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable

from kiln.artifact import WEIGHTS, read_manifest, write_in_place
from kiln.errors import KilnError
from kiln.interface import Manifest
from kiln.options import CompileOptions
from kiln.weights.generated import check_replaceable, record_weights


def _config_differences(ours: dict, recorded: dict) -> list[str]:
    """The fields in which kiln's reading of a config differs from a manifest's (as JSON gives it back)."""
    ours = json.loads(json.dumps(ours))
    return sorted(k for k in ours.keys() | recorded.keys() if ours.get(k) != recorded.get(k))


def planned_graph(model, manifest: Manifest):
    """The graph after the passes the artifact's compile ran, planned from its manifest alone."""
    from kiln.passes.pipeline import pipeline_for, run_pipeline
    from kiln.targets import planned_target
    quant = manifest.quantization
    target = planned_target(manifest.target.name, manifest.target.arch, quant.activation_block)
    # the head and the table in the formats the manifest records (defaults for them have changed before)
    options = CompileOptions(target=target, quant=None if quant.weights == "none" else quant.weights,
                             quant_lm_head=quant.lm_head, group_size=quant.group_size or 32,
                             lm_head_quant=quant.lm_head_format or quant.weights,
                             tensor_quant=tuple((quant.tensor_formats or {}).items()),
                             tensor_classes=tuple((c, f) for c, f in (quant.tensor_classes or {}).items()
                                                  if c not in ("lm_head", "embedding")),
                             embedding_quant=None if quant.embedding == "none" else quant.embedding,
                             more_bits=quant.more_bits is not None,
                             kv_dtype=None if quant.kv_cache == "none" else quant.kv_cache,
                             quant_embedding=quant.embedding != "none",
                             # a latent (MLA) model's prefill entry starts at compile's --mla-expanded-from (0: none)
                             mla_expanded_from=manifest.prefill_min_tokens or 0
                             if "mla" in manifest.attention_variants else None,
                             int8_activations=quant.activation_block > 0 if quant.weights != "none" else None,
                             float_activations=tuple(((quant.calibration or {}).get("activations") or {})
                                                     .get("float", ())),
                             scale_dtype=quant.scale_dtype or "float16")
    model.default_options(options)     # what an importer keeps of the options' formats (an ONNX file's scales)
    ran = {p["name"] for p in manifest.passes}
    passes = [rewrite for rewrite in pipeline_for(target, options) if rewrite.name in ran]
    graph, _ = run_pipeline(model.build_graph(manifest.dtype, manifest.kv.page_size), target, passes=passes)
    return graph


def attach_weights(artifact_dir: str | Path, model_dir: str | Path, force: bool = False,
                   progress: Callable[[str, float], None] | None = None) -> Manifest:
    """Write `model_dir`'s weights into `artifact_dir` (compiled with --no-weights from a model of the
    same config) and record them in its manifest; return the new manifest. The file is written
    beside its place and renamed there, then the manifest likewise (as `kiln fill-weights` does)."""
    from kiln.weights.convert import write_weights
    from kiln.frontend import load_model
    artifact_dir = Path(artifact_dir)
    manifest = read_manifest(artifact_dir, verify=False)
    check_replaceable(artifact_dir, manifest, force, "attach-weights")
    model = load_model(model_dir)
    differ = _config_differences(model.config.to_json(), manifest.model.config)
    if differ:
        raise KilnError(f"{model_dir} is not the model {artifact_dir} was compiled from: its config differs in "
                        f"{', '.join(differ)}")
    graph = planned_graph(model, manifest)
    stored = manifest.weights
    missing = [w.param for w in stored if w.param not in graph.params]
    if missing:
        raise KilnError(f"the passes planned from {artifact_dir}'s manifest give no param {', '.join(missing[:5])}: "
                        "the artifact was compiled by another kiln or its manifest was changed")
    importance = None
    if manifest.quantization.calibration:
        from kiln.calibrate import read_importance
        importance = read_importance(artifact_dir)
    digest = write_in_place(artifact_dir / WEIGHTS, lambda partial: write_weights(
        model, graph, stored, manifest.dtype, partial, progress, importance))
    manifest = manifest.replace(model=dataclasses.replace(manifest.model, source=str(Path(model_dir).resolve())))
    return record_weights(artifact_dir, manifest, "checkpoint", digest)
