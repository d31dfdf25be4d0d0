"""Open an artifact and run its compiled steps: weights and KV pages on the device, logits back.

Uses only TVM's runtime (no compiler) and NumPy. A CPU artifact's weights are the memory map of its
weights file, handed to TVM without a copy; a GPU artifact's are uploaded from that map one tensor at
a time. The files' checksums are checked in a background thread while this happens.

Each step runs the entry its shape calls for (`step_kind`): `forward` for any step, `decode` for
one new token per sequence, `prefill` for long chunks where the graph has prefill forms (MLA's
expanded attention, ir/step_forms.py), `decode_graph` (CUDA) for those of up to 64 sequences, padded to a batch
bucket with sequences on a scratch page so that each bucket replays one captured CUDA graph. The
step's small inputs go through persistent device buffers (runtime/step_buffers.py); the graph's are
fixed, as the captured graph reads them where they were at capture.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from kiln.artifact import WEIGHTS, read_manifest, start_verify
from kiln.cpu_tiles import request_tiles
from kiln.dtypes import numpy_dtype
from kiln.errors import KilnError
from kiln.interface import GRAPH_ENTRIES, GRAPH_ENTRY, WIDE_GRAPH_ENTRY, KVSpec, is_prefill_step
from kiln.safetensors_io import ALIGNMENT, map_file, read_header

from .device_sampler import DeviceSampler
from .flashinfer_plan import FlashInferPlanner
from .kv_transfer import layout_of, page_runs
from .launch import Launcher
from .step import context_rows, graph_step_capacities, no_context_rows, pad_decode_step
from .step_buffers import StepBuffers
from .tvm_bridge import device as open_device
from .tvm_bridge import empty, enable_cuda_runtime, host_bytes, load_vm, missing_cpu_features

DEVICES = ("cpu", "cuda", "rocm", "metal")


class CompiledModel:
    """The compiled forward of one artifact, with its weights loaded on the device."""

    def __init__(self, artifact_dir: str | Path, verify: bool = True):
        self.dir = Path(artifact_dir)
        self.manifest = m = read_manifest(self.dir, verify=False)
        if m.weights_source == "absent":
            raise KilnError(f"{self.dir} was compiled with --no-weights and has none: write a checkpoint's with "
                            f"`kiln attach-weights {self.dir} MODEL_DIR`, or draw seeded random ones with "
                            f"`kiln fill-weights {self.dir} --seed N`")
        verified = start_verify(self.dir, m) if verify else (lambda: None)
        device = m.target.device
        if device not in DEVICES:
            raise KilnError(f"artifact targets device {device!r}, which this runtime cannot drive")
        if device == "cuda":
            enable_cuda_runtime()
        self.device = open_device(device)
        if not self.device.exist:
            raise KilnError(f"artifact is built for {m.target.name} ({m.target.arch}), "
                            f"but this machine has no {device} device")
        if device == "cpu":
            missing = missing_cpu_features(list(m.target.cpu_features or ()))
            if missing:
                raise KilnError(f"artifact is compiled for a CPU with {', '.join(missing)}, which this CPU lacks: "
                                f"compile it on this machine, or for this CPU with --arch")
        # tile kernels ask Linux for AMX themselves and fall back; asking first makes the answer known
        self.tiles = request_tiles(m.target.tiles) if m.target.tiles else None
        # one page pool for every layer: page p is page p of each layer's tensor (kiln/interface.py KVSpec)
        self.kv_specs = [KVSpec.from_json(layer) for layer in m.kv.layers]
        self.page_size = m.kv.page_size
        self.vocab_size = m.vocab_size
        self.max_context = m.max_context
        self.vm = load_vm(self.dir / m.library, self.device)
        # step kind -> compiled function: "mixed" runs any step, "decode" (where built) decode-only
        # ones, "decode_graph" (where built) decode steps of up to max(graph_batches) sequences,
        # padded to a batch bucket and replayed as a CUDA graph
        self.entries = {step: self.vm[name] for step, name in m.step_entries.items()}
        self.graph_batches = m.graph_batches if GRAPH_ENTRY in self.entries else ()
        self.prefill_min_tokens = m.prefill_min_tokens if "prefill" in self.entries else None
        self.decode_gemm_from = m.decode_gemm_from or 0
        self.decode_mma_from = (m.decode_mma_from or 0) if "decode_wide" in self.entries else 0
        self.step_buffers = StepBuffers(self.device)
        # artifacts built with sampling on the device: the engine samples there (runtime/device_sampler.py)
        self.sampler = DeviceSampler(self.vm, self.device) if m.sampling == "device" else None
        self.graph_buffers: StepBuffers | None = None      # fixed addresses, made by allocate_kv
        self.launcher: Launcher | None = None               # made by the first launch
        self.weights = self._load_weights()
        verified()
        self.kv_tensors: dict = {}         # each layer's KV inputs (kiln/interface.py KVSpec), made by allocate_kv
        self.lora = m.lora                 # adapter slots (kiln/interface.py LoRALayout), or None
        self.lora_tensors = self._allocate_lora() if m.lora else {}
        self.input_names = list(m.inputs)
        # artifacts with FlashInfer's prefill: its plans, made per step on the host
        self.planner = FlashInferPlanner(m.flashinfer, self.dir / m.library, self.device, self.page_size) \
            if m.flashinfer else None

    def _load_weights(self) -> list:
        """The weights in argument order: views of the file's memory map on the CPU, uploads from it
        elsewhere. A tensor at an offset TVM cannot take as it is (artifacts written before weights
        were aligned) is copied instead."""
        path = self.dir / WEIGHTS
        entries, _ = read_header(path)
        mapped = map_file(path)
        on_host = self.maps_weights()
        tensors = []
        for w in self.manifest.weights:
            entry = entries.get(w.name)
            if entry is None:
                raise KilnError(f"weight {w.name} named in the manifest is not in {WEIGHTS}")
            float8_as_bytes = entry.dtype == "uint8" and w.dtype.startswith("float8")
            if tuple(entry.shape) != w.shape or not (entry.dtype == w.dtype or float8_as_bytes):
                raise KilnError(f"weight {w.name} is {entry.dtype}{list(entry.shape)} in {WEIGHTS}, "
                                f"the manifest says {w.dtype}{list(w.shape)}")
            raw = mapped[entry.begin:entry.end]
            whole = host_bytes(raw, copy=bool(entry.begin % ALIGNMENT))
            host = whole._create_view(w.shape, w.dtype)        # the view keeps `whole`'s bytes
            if on_host:
                tensors.append(host)
            else:
                tensors.append(empty(w.shape, w.dtype, self.device))
                tensors[-1].copyfrom(host)
        return tensors

    def maps_weights(self) -> bool:
        """Whether the kernels read the weights where the file's memory map has them: the device is
        the host. Elsewhere each tensor is uploaded from the map."""
        return self.manifest.target.device == "cpu"

    @property
    def kv_window(self) -> int | None:
        """The widest sliding window of any layer, or None when a layer attends to all keys: the
        page pool frees pages outside it."""
        if any(spec.kind != "sliding" for spec in self.kv_specs):
            return None
        return max(spec.window for spec in self.kv_specs)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token takes over all layers, each as its spec stores it."""
        return sum(spec.bytes_per_token for spec in self.kv_specs)

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size

    def allocate_kv(self, kv_memory_bytes: int) -> int:
        """Allocate the KV page tensors (one per layer) within the budget; return the page count."""
        if self.kv_tensors and self.graph_batches:
            raise KilnError("allocate_kv runs once for an artifact with CUDA graphs: captured graphs keep "
                            "the pages' addresses")
        num_pages = kv_memory_bytes // self.bytes_per_page
        if num_pages < 1:
            raise KilnError(f"KV memory budget {kv_memory_bytes} bytes is below one page "
                            f"({self.bytes_per_page} bytes)")
        # graph steps pad their batch with sequences that write and read one scratch page past the pool's
        self.scratch_page = num_pages if self.graph_batches else None
        tensor_pages = num_pages + bool(self.graph_batches)
        self.kv_tensors = {}
        for layer, spec in enumerate(self.kv_specs):
            for name, (shape, dtype) in spec.tensors(layer, tensor_pages).items():
                self.kv_tensors[name] = empty(shape, dtype, self.device)
        if self.graph_batches:
            self.graph_buffers = StepBuffers(self.device, graph_step_capacities(
                max(self.graph_batches), -(-self.max_context // self.page_size)), fixed=True)
        return num_pages

    def _allocate_lora(self) -> dict:
        """The stacked adapter inputs of every site, all slots zero (no adapter)."""
        tensors, layout = {}, self.lora
        for site in layout.sites:
            for name, shape in ((site.a, (layout.max_loras, layout.max_rank * len(site.modules), site.inputs)),
                                (site.b, (layout.max_loras, layout.max_rank, sum(site.rows)))):
                tensors[name] = empty(shape, layout.dtype, self.device)
                tensors[name].copyfrom(np.zeros(shape, numpy_dtype(layout.dtype)))
        return tensors

    def write_lora_slot(self, slot: int, rows: dict[str, np.ndarray]) -> None:
        """Write one slot of every stacked adapter input (runtime/lora.py slot_rows gives `rows`)."""
        dtype = numpy_dtype(self.lora.dtype)
        for name, tensor in self.lora_tensors.items():
            _pages(tensor, slot, 1).copyfrom(np.ascontiguousarray(rows[name][None].astype(dtype)))

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV pages (every layer, k and v, and row scales) from source to destination
        page: the copy-on-write of a shared page, done on the device through views."""
        for tensor in self.kv_tensors.values():
            for src, dst in pairs:
                _pages(tensor, dst, 1).copyfrom(_pages(tensor, src, 1))

    @property
    def kv_layout(self) -> str:
        """The page format of this artifact's KV tensors (runtime/kv_transfer.py)."""
        return layout_of(self.page_size, {name: (tuple(t.shape[1:]), str(t.dtype)) for name, t in self.kv_tensors.items()})

    def read_pages(self, pages: list[int]) -> dict[str, np.ndarray]:
        """The pages' contents (at least one page), each KV tensor's as [len(pages), ...page shape] on
        the host: one copy per run of consecutive pages."""
        return {name: np.concatenate([_pages(tensor, first, count).numpy() for _, first, count in page_runs(pages)])
                for name, tensor in self.kv_tensors.items()}

    def write_pages(self, pages: list[int], contents: dict[str, np.ndarray]) -> None:
        """Write `contents` (as read_pages gives them) into the pages."""
        for name, tensor in self.kv_tensors.items():
            for at, first, count in page_runs(pages):
                _pages(tensor, first, count).copyfrom(np.ascontiguousarray(contents[name][at:at + count]))

    def forward(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        """Run one ragged step; return f32[seqs, vocab], the logits of each sequence's last new token."""
        return self.run(inputs).numpy()

    def run(self, inputs: dict[str, np.ndarray]):
        """Run one ragged step; return its logits rows as a tensor on the device."""
        return self.call(*self.step_args(inputs))

    def step_args(self, inputs: dict[str, np.ndarray]) -> tuple[str, list, int]:
        """(the entry a step runs, its arguments with the step's inputs uploaded, its sequences)."""
        if not self.kv_tensors:
            raise KilnError("allocate_kv must be called before forward")
        kind = self.step_kind(inputs)
        seqs = len(inputs["q_indptr"]) - 1
        if "kv_slots" in self.input_names:         # read by the prefill entry's forms only
            context = context_rows(inputs, self.page_size) if kind == "prefill" else no_context_rows(seqs)
            inputs = {**inputs, **context}
        buffers, lengths = self.step_buffers, {}
        if kind in GRAPH_ENTRIES:
            inputs = pad_decode_step(inputs, min(b for b in self.graph_batches if b >= seqs), self.scratch_page,
                                     self.page_size)
            # the whole buffer, every step: its length is part of the captured graph's key
            buffers, lengths = self.graph_buffers, {"page_values": self.graph_buffers.capacity("page_values")}
        planned = self.planner.inputs(inputs, kind) if self.planner else {}
        args = [self.kv_tensors[n] if n in self.kv_tensors else self.lora_tensors[n] if n in self.lora_tensors
                else planned[n] if n in planned else buffers.put(n, inputs[n], lengths.get(n))
                for n in self.input_names]
        return kind, args, seqs

    def call(self, kind: str, args: list, seqs: int):
        """Run entry `kind` on `args` (from step_args); its logits rows, on the device."""
        out = self.entries[kind](*args, *self.weights)
        return out._create_view((seqs, out.shape[1]), out.dtype) if kind in GRAPH_ENTRIES else out

    def launch(self, inputs, copies, rows, states, previous, feed, keep_logits: bool = False):
        """Start a step now and read it back later (runtime/launch.py; the one-step-ahead engine)."""
        if self.launcher is None:
            self.launcher = Launcher(self)
        return self.launcher.launch(inputs, copies, rows, states, previous, feed, keep_logits)

    def step_kind(self, inputs: dict[str, np.ndarray]) -> str:
        """The entry a step runs: where the artifact has them, "decode_graph" or "decode" when every
        sequence brings one new token (the graph up to its largest batch bucket; "mixed", whose
        linears are GEMMs, from decode_gemm_from sequences; "decode_wide_graph" or "decode_wide",
        whose linears run on tensor cores, from decode_mma_from sequences), "prefill" when every sequence brings at
        least prefill_min_tokens (ir/step_forms.py), else "mixed"."""
        seqs = len(inputs["q_indptr"]) - 1
        if len(inputs["tokens"]) != seqs:
            prefill = self.prefill_min_tokens is not None and is_prefill_step(inputs["q_indptr"],
                                                                            self.prefill_min_tokens)
            return "prefill" if prefill else "mixed"
        wide = bool(self.decode_mma_from) and seqs >= self.decode_mma_from
        if self.graph_batches and seqs <= max(self.graph_batches):
            return WIDE_GRAPH_ENTRY if wide and WIDE_GRAPH_ENTRY in self.entries else GRAPH_ENTRY
        if wide:
            return "decode_wide"
        gemm = self.decode_gemm_from and seqs >= self.decode_gemm_from
        return "decode" if "decode" in self.entries and not gemm else "mixed"


def _pages(tensor, first: int, count: int):
    """A view of pages first..first+count-1 of a KV tensor (pages on its first axis)."""
    page_shape = tuple(tensor.shape[1:])
    page_bytes = int(np.prod(page_shape)) * tensor.dtype.itemsize
    return tensor._create_view((count, *page_shape), relative_byte_offset=first * page_bytes)
