"""LoRA adapters as PEFT saves them (adapter_config.json + adapter_model.safetensors or .bin), checked
against an artifact's adapter slots and laid out as one slot's rows of each stacked input.

An adapter's module m has A [r, in] (lora_A) and B [out, r] (lora_B); its term on x is
scale · (x · Aᵀ) · Bᵀ with scale = alpha / r, or alpha / √r with rsLoRA (PEFT's use_rslora), alpha and
r per module where rank_pattern / alpha_pattern name it. A slot holds, for a projection of parts
m_1..m_P (ir/lora_ops.py): A rows j·R..j·R + r = A_mj, and B rows 0..r of m_j's own output columns =
(scale · B_mj)ᵀ; zeros elsewhere (a module the adapter leaves out, ranks below R).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kiln.errors import KilnError
from kiln.interface import LoRALayout


class LoRAError(KilnError):
    """An adapter that cannot be used: a missing or malformed file, another base model's shapes, a rank
    over the artifact's slots, modules it has no slot for, or an unknown adapter named by a request."""


@dataclass(frozen=True)
class LoRARequest:
    """A request's adapter, as vLLM names one: a name, a positive id unique among adapters, its folder."""
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise LoRAError(f"LoRARequest {self.lora_name!r}: lora_int_id must be a positive int, "
                            f"got {self.lora_int_id!r}")


@dataclass
class Adapter:
    name: str
    path: str
    base_model: str | None
    modules: dict[str, tuple[np.ndarray, np.ndarray, float]] = field(default_factory=dict)  # m -> A, B, scale

    @property
    def rank(self) -> int:
        return max(a.shape[0] for a, _, _ in self.modules.values())


_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<half>[AB])(?:\.[A-Za-z0-9_-]+)?\.weight$")
_REFUSED = {"use_dora": "DoRA (use_dora)", "fan_in_fan_out": "fan_in_fan_out weights"}


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: the value of the first key that is the module's name or a
    suffix of it after a dot (the key read as a regular expression), else `default`."""
    for key, value in (patterns or {}).items():
        if re.fullmatch(rf"(?:.*\.)?(?:{key})", module):
            return value
    return default


def _tensors(folder: Path) -> dict[str, np.ndarray]:
    from kiln.safetensors_io import read_header, read_tensor
    st, binary = folder / "adapter_model.safetensors", folder / "adapter_model.bin"
    if st.exists():
        entries, _ = read_header(st)
        return {name: np.asarray(read_tensor(st, e), np.float32) for name, e in entries.items()}
    if binary.exists():
        from .torch_pickle import load_tensors
        try:
            return {name: np.asarray(t, np.float32) for name, t in load_tensors(binary).items()}
        except KilnError as e:
            raise LoRAError(str(e)) from None
    raise LoRAError(f"{folder}: no adapter_model.safetensors or adapter_model.bin")


def read_adapter(path: str | Path, name: str | None = None) -> Adapter:
    """The PEFT LoRA adapter saved in folder `path`: each module's A, B and scale (float32)."""
    folder = Path(path)
    name = name or folder.name
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
    except (OSError, ValueError) as e:
        raise LoRAError(f"adapter {name}: cannot read {folder / 'adapter_config.json'} ({e})") from None
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAError(f"adapter {name}: peft_type {config.get('peft_type')} is not LORA")
    refused = [what for key, what in _REFUSED.items() if config.get(key)]
    if config.get("bias", "none") != "none":
        refused.append(f"trained biases (bias={config['bias']})")
    if config.get("modules_to_save"):
        refused.append(f"modules_to_save {config['modules_to_save']}")
    if refused:
        raise LoRAError(f"adapter {name}: kiln serves plain LoRA; this one has {', '.join(refused)}")
    halves: dict[str, dict[str, np.ndarray]] = {}
    for key, tensor in _tensors(folder).items():
        found = _KEY.match(key)
        if not found:
            raise LoRAError(f"adapter {name}: tensor {key} is not a LoRA A or B weight (kiln reads only those)")
        halves.setdefault(found["module"], {})[found["half"]] = tensor
    if not halves:
        raise LoRAError(f"adapter {name}: its weights hold no LoRA tensors")
    adapter = Adapter(name, str(folder), config.get("base_model_name_or_path"))
    for module, pair in sorted(halves.items()):
        if set(pair) != {"A", "B"} or pair["A"].ndim != 2 or pair["B"].ndim != 2 \
                or pair["A"].shape[0] != pair["B"].shape[1]:
            raise LoRAError(f"adapter {name}: module {module} needs lora_A [r, in] and lora_B [out, r], got "
                            f"{ {h: list(t.shape) for h, t in pair.items()} }")
        r = pair["A"].shape[0]
        alpha = float(_pattern_value(config.get("alpha_pattern"), module, config.get("lora_alpha", 8)))
        declared = int(_pattern_value(config.get("rank_pattern"), module, config.get("r", r)))
        if declared != r:
            raise LoRAError(f"adapter {name}: module {module} has rank {r}, its config says {declared}")
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        adapter.modules[module] = (pair["A"], pair["B"], scale)
    return adapter


def no_slots(name: str) -> LoRAError:
    """The error for an adapter asked of an artifact compiled without adapter slots."""
    return LoRAError(f"adapter {name}: the artifact has no adapter slots (compile it with --max-loras N "
                     "[--max-lora-rank R])")


def check_adapter(adapter: Adapter, layout: LoRALayout | None) -> None:
    """Refuse (LoRAError naming it) an adapter the artifact's slots cannot hold."""
    if layout is None:
        raise no_slots(adapter.name)
    where = {m: (site, j) for site in layout.sites for j, m in enumerate(site.modules)}
    unknown = sorted(set(adapter.modules) - set(where))
    if unknown:
        raise LoRAError(f"adapter {adapter.name}: modules {', '.join(unknown[:4])}{' ...' if len(unknown) > 4 else ''}"
                        " are not projections this artifact gives adapters (q/k/v/o/gate/up/down of its layers)")
    for module, (a, b, _) in adapter.modules.items():
        site, j = where[module]
        if a.shape[0] > layout.max_rank:
            raise LoRAError(f"adapter {adapter.name}: module {module} has rank {a.shape[0]}, over the "
                            f"artifact's --max-lora-rank {layout.max_rank}")
        if a.shape[1] != site.inputs or b.shape[0] != site.rows[j]:
            raise LoRAError(f"adapter {adapter.name}: module {module} is [{b.shape[0]} x {a.shape[1]}], the "
                            f"model's is [{site.rows[j]} x {site.inputs}]: an adapter of another base model")


def slot_rows(adapter: Adapter | None, layout: LoRALayout) -> dict[str, np.ndarray]:
    """Each stacked input's rows for one slot holding `adapter` (None: zeros), in float32:
    {a name: [P·R, in], b name: [R, out]}."""
    rank, out = layout.max_rank, {}
    for site in layout.sites:
        a = np.zeros((rank * len(site.modules), site.inputs), np.float32)
        b = np.zeros((rank, sum(site.rows)), np.float32)
        first = 0
        for j, (module, rows) in enumerate(zip(site.modules, site.rows)):
            if adapter is not None and module in adapter.modules:
                down, up, scale = adapter.modules[module]
                r = down.shape[0]
                a[j * rank:j * rank + r] = down
                b[:r, first:first + rows] = (up * np.float32(scale)).T
            first += rows
        out[site.a], out[site.b] = a, b
    return out
