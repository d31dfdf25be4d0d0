"""The `kiln` command: compile, run, inspect.

Errors in the user's input print one line on stderr and exit with code 2;
`kiln --debug ...` shows the traceback instead.
"""
from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path

import click

import kiln
from kiln.errors import KilnError
from kiln.options import ATTENTION_CHOICES, DTYPES, GROUP_SIZES, KV_DTYPES, TENSOR_CLASSES, WEIGHT_QUANTS
from kiln.serve.reasoning import PARSERS as REASONING_PARSERS
from kiln.serve.tool_calls import FORMATS as TOOL_FORMATS

TOOL_CALL_PARSERS = list(TOOL_FORMATS)


THREADS_HELP = ("CPU threads for the model's kernels (default: $TVM_NUM_THREADS if set, else every core this "
                "process may run on).")


def _err(line: str) -> None:
    click.echo(line, err=True)


def _kv_memory(ctx, param, value: str) -> str:
    from kiln.runtime.memory import check_kv_memory
    try:
        return check_kv_memory(value)
    except KilnError as e:
        raise click.BadParameter(str(e)) from None


class _Main(click.Group):
    def invoke(self, ctx):
        interrupts = _Interrupts()
        try:
            with interrupts:
                return super().invoke(ctx)
        except (KilnError, ValueError, OSError) as e:
            if ctx.params.get("debug"):
                raise
            _err(f"kiln: error: {e}")
            sys.exit(2)
        except Exception:
            # TVM's FFI turns a Ctrl-C (or SIGTERM) inside a C++ call into a RuntimeError: it is still one
            if interrupts.seen is not None and not ctx.params.get("debug"):
                interrupts.raise_again()
            raise


class _Interrupts:
    """SIGINT raises KeyboardInterrupt (as Python's own handler does) and SIGTERM SystemExit(143), so
    that what a command wrote half-way is removed on either (a SIGTERM would otherwise end the process
    where it stands); the signal is noted, so an error a library made of it can be told apart."""

    RAISES = {signal.SIGINT: KeyboardInterrupt, signal.SIGTERM: lambda: SystemExit(128 + signal.SIGTERM)}

    def __init__(self):
        self.seen: int | None = None
        self.previous: dict = {}

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():     # signals reach the main thread alone
            return self
        for sig, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
            if signal.getsignal(sig) is default:          # only where nobody else handles it
                self.previous[sig] = default
                signal.signal(sig, self._handle)
        return self

    def _handle(self, sig, frame):
        self.seen = sig
        self.raise_again()

    def raise_again(self):
        raise self.RAISES[self.seen]() from None

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            if signal.getsignal(sig) is self._handle:
                signal.signal(sig, handler)
        return False


@click.group(cls=_Main)
@click.option("--debug", is_flag=True, help="Show tracebacks.")
@click.version_option(kiln.__version__, "--version", prog_name="kiln", message="%(prog)s %(version)s")
def main(debug):
    """kiln: compile Hugging Face models with TVM and run them."""


def _tensor_classes(values: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """--tensor-quant's CLASS=FORMAT items (repeated or comma-separated), in order; a later one wins."""
    pairs = {}
    for item in (part.strip() for value in values for part in value.split(",") if part.strip()):
        cls, sep, fmt = item.partition("=")
        if not sep:
            raise KilnError(f"--tensor-quant {item}: expected CLASS=FORMAT, e.g. lm_head=q8")
        pairs[cls.strip()] = fmt.strip()
    return tuple(pairs.items())


@main.command()
@click.argument("model_dir")
@click.option("--target", default="cpu", show_default=True, help="cpu, cuda, rocm or metal.")
@click.option("--arch", default=None, help="GPU architecture: sm_80 (default)/sm_90 for cuda, "
              "gfx942 (default)/gfx90a for rocm, m1 (default)/m2 for metal; for cpu a CPU model by LLVM's "
              "name (sapphirerapids, znver4, x86-64-v4, …; default: this machine's CPU).")
@click.option("--dtype", type=click.Choice(DTYPES), default=None,
              help="Weight and activation dtype (default: float32 on cpu, float16 on GPUs).")
@click.option("--quant", type=click.Choice(["f32", "f16", "bf16", *WEIGHT_QUANTS]), default=None,
              help="f32/f16/bf16: that dtype, unquantised; default: the model's own (a GGUF file's, else "
                   "unquantised); q8: int8 weights with per-channel scales; q4: int4 weights in groups with "
                   "float16 scales; q8g: int8 in groups (cpu); q4a: int4 in groups with a float16 scale and "
                   "minimum each (cpu, cuda); q4k: int4 in super-blocks of 256 with 6-bit scales and minimums per "
                   "group of 32, GGUF's Q4_K (cpu, cuda; where 256 does not divide a weight's inputs, q4a); "
                   "fp8: float8 e4m3 weights with per-channel scales (cuda sm_89+, and cpu in software).")
@click.option("--group-size", type=click.Choice([str(g) for g in GROUP_SIZES]), default="32", show_default=True,
              help="q4: input channels per scale.")
@click.option("--group-scales", type=click.Choice(["auto", "float16", "float32"]), default="auto", show_default=True,
              help="q4, q8g, q4a: their group scales in float16, or float32 (cpu: an ONNX file's float32 MatMulNBits "
                   "scales kept as they are, onnxruntime's numbers, for a table twice the size); auto: float32 for "
                   "such a file compiled for the CPU, else float16.")
@click.option("--quant-lm-head/--no-quant-lm-head", default=True, show_default=True,
              help="Quantise the LM head too (q8 under q4, q4a and q4k, else --quant's scheme).")
@click.option("--quant-embedding/--no-quant-embedding", default=True, show_default=True,
              help="With --quant: quantise the embedding table too (q8 under 4-bit schemes; a table tied to an "
                   "LM head of the same format is stored once); --no-quant-embedding keeps it in --dtype.")
@click.option("--tensor-quant", multiple=True, metavar="CLASS=FORMAT",
              help="With --quant: FORMAT (a --quant scheme, or none for float) for one class of tensors: "
                   f"{', '.join(TENSOR_CLASSES)} (a projection before its class; repeatable or "
                   "comma-separated), e.g. --tensor-quant lm_head=q4,down=q8.")
@click.option("--calibrate", default=None, metavar="TEXT_FILE",
              help="With --quant: run the float model over this text (up to 8192 tokens); q4, q4a and q4k weigh "
                   "each weight's rounding by how large its input is there (an importance matrix, as "
                   "llama-imatrix's), and a linear whose int8 activations measure an output error above 5 % "
                   "keeps float ones; the artifact keeps the measurement.")
@click.option("--kv-dtype", type=click.Choice(["auto", *KV_DTYPES]), default="auto", show_default=True,
              help="KV cache storage: auto (the model dtype), int8 or fp8 (e4m3), both with a float32 scale "
                   "per token and KV head.")
@click.option("-o", "--output", required=True,
              help="Artifact directory to write: a new path or an empty directory (or a kiln artifact, "
                   "with --force).")
@click.option("--force", is_flag=True, help="Replace the kiln artifact at -o (only ever a kiln artifact; the old "
              "one stays until the new one is complete).")
@click.option("--print-after-all", is_flag=True, help="Print the IR after import and after every pass.")
@click.option("--print-after", multiple=True, metavar="PASS", help="Print the IR after this pass (repeatable).")
@click.option("--disable-pass", multiple=True, metavar="PASS", help="Skip this pass (repeatable).")
@click.option("--mla-expanded-from", default=None, type=click.IntRange(min=0), metavar="N",
              help="MLA models: prefill steps whose every sequence brings at least N new tokens attend over "
                   "K and V rebuilt from the latent cache (the expanded form); 0: the absorbed form in every "
                   "step. Default: the target's (cpu: where it measured faster).")
@click.option("--activations", type=click.Choice(["int8", "float"]), default=None,
              help="q8/q4: int8 quantises each linear's input rows in blocks of 32 and multiplies in integer "
                   "dot products (as llama.cpp's Q8_0 does); float keeps float activations. Default: int8 "
                   "where the target has the kernel (cpu with AVX2), else float; with --calibrate, float "
                   "for the linears where int8 measured an output error above 5 %.")
@click.option("--attention", type=click.Choice(ATTENTION_CHOICES), default="builtin", show_default=True,
              help="cuda: flashinfer links FlashInfer's batch prefill (tensor cores) into the artifact for "
                   "every step that is not a plain decode (needs flashinfer-python at compile time: make "
                   "flashinfer-deps; not at run time); builtin: kiln's and TVM's kernels.")
@click.option("--max-loras", default=0, show_default=True, type=click.IntRange(min=0), metavar="N",
              help="Compile N LoRA adapter slots in (cpu): requests may then name PEFT adapters (kiln serve "
                   "--lora-modules, kiln.LLM's lora_request), up to N different ones in a step.")
@click.option("--max-lora-rank", default=16, show_default=True, type=click.IntRange(min=1), metavar="R",
              help="The largest adapter rank the slots hold.")
@click.option("--lora-dtype", default=None, type=click.Choice(["float32", "bfloat16", "float16"]),
              help="The adapter slots' dtype (default: bfloat16 beside quantised CPU weights, else the model's).")
@click.option("--weights/--no-weights", default=True, show_default=True,
              help="--no-weights: write no weights file (for a machine the weights cannot be sent to: "
                   "`kiln attach-weights` writes a checkpoint's there, `kiln fill-weights` seeded random ones).")
def compile(model_dir, target, arch, dtype, quant, group_size, group_scales, quant_lm_head, quant_embedding,
            tensor_quant, calibrate, kv_dtype, output, force, print_after_all, print_after, disable_pass,
            mla_expanded_from, activations, attention, max_loras, max_lora_rank, lora_dtype, weights):
    """Compile MODEL_DIR (a Hugging Face model directory, or a GGUF file) into an artifact.

    A GGUF file keeps its numbers where kiln stores its format (F32/F16/BF16; Q4_0 as q4, Q8_0 as q8g,
    Q4_1 as q4a, Q4_K as q4k, in groups of 32); other types are requantised (q8g) unless --quant names a
    format (f32/f16/bf16: unquantised).

    The artifact is written beside -o and moved there when complete: a failed or interrupted compile
    leaves nothing behind, and nothing but a kiln artifact (with --force) is ever replaced.
    KILN_DUMP=DIR writes the IR after import and after every pass into DIR, one file each."""
    from kiln.compiler import compile_model
    from kiln.options import CompileOptions
    from kiln.passes.pipeline import make_dumper
    t0 = time.perf_counter()
    dump = make_dumper(set(print_after), print_after_all, out=lambda text: click.echo(text, err=True))
    as_dtype = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}
    if quant in as_dtype:
        if dtype and dtype != as_dtype[quant]:
            raise KilnError(f"--quant {quant} means --dtype {as_dtype[quant]}, not {dtype}")
        dtype, quant = as_dtype[quant], "none"
    options = CompileOptions(target=target, arch=arch, dtype=dtype, quant=quant, group_size=int(group_size),
                             scale_dtype="" if group_scales == "auto" else group_scales,
                             quant_lm_head=quant_lm_head, quant_embedding=quant_embedding,
                             tensor_classes=_tensor_classes(tensor_quant), calibrate=calibrate,
                             kv_dtype=None if kv_dtype == "auto" else kv_dtype,
                             int8_activations=None if activations is None else activations == "int8",
                             mla_expanded_from=mla_expanded_from, disable_passes=frozenset(disable_pass),
                             attention=attention, weights=weights, max_loras=max_loras,
                             max_lora_rank=max_lora_rank, lora_dtype=lora_dtype)
    m = compile_model(model_dir, output, options, force=force, dump=dump)
    _err(f"wrote {output} (target {target}): {len(m.kernels)} kernels, {m.dtype}, "
         f"{sum(f['bytes'] for f in m.files.values()) / 2**20:.1f} MiB in {time.perf_counter() - t0:.1f}s"
         + ("" if weights else "; no weights (kiln attach-weights or fill-weights writes them)"))


@main.command()
@click.argument("artifact")
@click.option("--verify", is_flag=True, help="Also check every file against its manifest checksum.")
def inspect(artifact, verify):
    """Print a summary of a compiled ARTIFACT."""
    from kiln import inspect as inspect_artifact
    click.echo(inspect_artifact.summary(artifact))
    if verify:
        click.echo(inspect_artifact.verify(artifact))


@main.command("fill-weights")
@click.argument("artifact")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0),
              help="The same seed gives the same bytes.")
@click.option("--force", is_flag=True, help="Redraw weights this command wrote before (never a checkpoint's).")
def fill_weights(artifact, seed, force):
    """Write seeded random weights into ARTIFACT, compiled with --no-weights: for benchmarks, not a trained model.

    One tensor per manifest weight, with its shape and dtype, drawn on every core and recorded in the
    manifest with its seed. Weights from a checkpoint are never replaced."""
    from kiln.artifact import WEIGHTS
    from kiln.compiler import Phases
    from kiln.weights.generated import fill_weights as fill
    phases = Phases(_err)
    m = phases.run("weights", fill, artifact, seed, force, phases.progress)
    size, seconds = m.files[WEIGHTS]["bytes"], phases.seconds["weights"]
    _err(f"wrote {artifact}: {len(m.weights)} tensors, {size / 2**20:.1f} MiB of seeded random weights "
         f"(seed {seed}) in {seconds:.1f}s ({size / 2**30 / max(seconds, 1e-3):.1f} GiB/s)")


@main.command("attach-weights")
@click.argument("artifact")
@click.argument("model_dir")
@click.option("--force", is_flag=True, help="Replace weights `kiln fill-weights` drew (never a checkpoint's).")
def attach_weights(artifact, model_dir, force):
    """Write MODEL_DIR's weights into ARTIFACT, compiled from a model of the same config with --no-weights.

    The weights are converted as compile converts them (fused, quantised, laid out), where the
    checkpoint is: a machine with TVM's runtime alone will do. Weights from a checkpoint are never
    replaced."""
    from kiln.artifact import WEIGHTS
    from kiln.weights.attach import attach_weights as attach
    from kiln.compiler import Phases
    phases = Phases(_err)
    m = phases.run("weights", attach, artifact, model_dir, force, phases.progress)
    _err(f"wrote {artifact}: {len(m.weights)} tensors, {m.files[WEIGHTS]['bytes'] / 2**20:.1f} MiB of "
         f"{model_dir}'s weights in {phases.seconds['weights']:.1f}s")


def _engine_options(command):
    """The engine options `kiln run` and `kiln serve` share (runtime/config.py EngineConfig)."""
    for option in reversed((
        click.option("--kv-memory", default="auto", show_default=True, callback=_kv_memory,
                     help="KV cache budget: a size (512MiB), a fraction of free memory (0.3) or auto."),
        click.option("--threads", default=None, type=click.IntRange(min=1), help=THREADS_HELP),
        click.option("--speculative", default=None, metavar="ngram|draft:ARTIFACT",
                     help="Speculative decoding: guess tokens by prompt lookup (ngram) or with a smaller draft "
                          "model compiled for the same target, and keep those the model confirms (the same "
                          "outputs)."),
        click.option("--num-speculative-tokens", default=4, show_default=True, type=click.IntRange(1, 16),
                     help="The most tokens guessed per step (fewer where a sequence's guesses are often wrong)."),
    )):
        command = option(command)
    return command


def _lora_modules(values: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """--lora-modules NAME=PATH values (vLLM's form), each adapter folder checked to exist."""
    modules = []
    for value in values:
        name, _, path = value.partition("=")
        if not name or not path:
            raise KilnError(f"--lora-modules {value}: give NAME=PATH")
        if not (Path(path) / "adapter_config.json").is_file():
            raise KilnError(f"--lora-modules {value}: {path} holds no adapter_config.json (a PEFT adapter's folder)")
        modules.append((name, path))
    return tuple(modules)


def _engine_config(**settings):
    """The engine's config from its options, checked before anything loads: a draft model's artifact
    must exist."""
    from kiln.artifact import read_manifest
    from kiln.runtime.config import EngineConfig
    config = EngineConfig(**settings)
    if config.speculative is not None and config.speculative.draft is not None:
        read_manifest(config.speculative.draft, verify=False)
    return config


@main.command()
@click.argument("artifact")
@click.option("--prompt", default=None, help="Prompt text; without it, an interactive chat starts.")
@click.option("--max-tokens", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0), help="0 means greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0, 1, min_open=True))
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(min=0), help="0 means off.")
@click.option("--seed", default=None, type=click.IntRange(min=0))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
@click.option("--json-schema", "json_schema", default=None, type=click.File("r"), metavar="FILE",
              help="Constrain the output to JSON that validates against the schema in FILE.")
@_engine_options
def run(artifact, prompt, max_tokens, temperature, top_p, top_k, seed, as_json, json_schema, **engine):
    """Generate text with a compiled ARTIFACT."""
    # tvm_ffi imports torch whenever it is installed (seconds of start-up) though the runtime never
    # uses it; keep it out of this process.
    sys.modules.setdefault("torch", None)
    from kiln.runner import chat, run_prompt
    from kiln.runtime.grammar import GrammarSpec
    from kiln.runtime.sampler import SamplingParams
    structured = GrammarSpec("json_schema", json_schema.read(), "--json-schema") if json_schema else None
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, max_tokens=max_tokens,
                            structured=structured)
    config = _engine_config(**engine)
    if prompt is None:
        chat(artifact, params, config)
    else:
        run_prompt(artifact, prompt, params, config, as_json)


@main.command()
@click.argument("artifact")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to bind (loopback by default).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535),
              help="TCP port (0: one the system picks, printed at start).")
@click.option("--api-key", default=None, help="Require 'Authorization: Bearer KEY' on /v1/ routes.")
@click.option("--served-model-name", default=None, help="The model id clients use (default: the artifact's name).")
@click.option("--lora-modules", "lora_modules", multiple=True, metavar="NAME=PATH",
              help="Serve the PEFT LoRA adapter in folder PATH as model NAME (repeatable; the artifact needs "
                   "adapter slots: kiln compile --max-loras N).")
@click.option("--max-cpu-loras", default=None, type=click.IntRange(min=1),
              help="LoRA adapters kept read in memory (default: the artifact's slots); more are read again "
                   "from disk when used.")
@click.option("--allow-runtime-lora-updating", is_flag=True,
              help="Enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter.")
@_engine_options
@click.option("--max-num-seqs", default=64, show_default=True, type=click.IntRange(min=1),
              help="Sequences in one batch.")
@click.option("--max-batched-tokens", default=2048, show_default=True, type=click.IntRange(min=1),
              help="Tokens per engine step.")
@click.option("--prefix-caching/--no-prefix-caching", default=True, show_default=True)
@click.option("--max-waiting", default=512, show_default=True, type=click.IntRange(min=1),
              help="Queued requests before 429s.")
@click.option("--drain-timeout", default=30.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds running requests get to finish after SIGTERM or Ctrl-C.")
@click.option("--reasoning-parser", default=None, type=click.Choice(REASONING_PARSERS),
              help="Put a reasoning model's <think>...</think> text into reasoning_content.")
@click.option("--tool-call-parser", default=None, type=click.Choice(TOOL_CALL_PARSERS),
              help="The model's tool-call syntax (default: what its chat template writes).")
@click.option("--replicas", default=None, type=click.IntRange(min=1),
              help="Serve with this many engine replicas on Ray Serve (docs/DISTRIBUTED.md); without it, one "
                   "engine in this process.")
@click.option("--max-replicas", default=None, type=click.IntRange(min=1),
              help="With --replicas: let Ray Serve add replicas up to this many, on ongoing requests.")
@click.option("--prefill-replicas", default=0, show_default=True, type=click.IntRange(min=0),
              help="With --replicas: prefill on this many replicas of their own, decode on the --replicas "
                   "(the KV moves through Ray's object store).")
@click.option("--routing", default="prefix", show_default=True, type=click.Choice(["prefix", "round-robin"]),
              help="With --replicas: how requests pick a replica (prefix: the one that holds the prompt's "
                   "prefix pages, unless its queue is much longer).")
@click.option("--ray-address", default=None, help="With --replicas: a running Ray cluster (default: start a "
                                                    "local one).")
@click.option("--replica-cpus", default=None, type=click.FloatRange(min=0),
              help="With --replicas: CPUs Ray reserves per replica (default: --threads, else 1).")
@click.option("--replica-gpus", default=None, type=click.FloatRange(min=0),
              help="With --replicas: GPUs per replica (default: 1 for a GPU artifact, 0 for a CPU one).")
def serve(artifact, host, port, api_key, served_model_name, lora_modules, allow_runtime_lora_updating, drain_timeout,
          reasoning_parser, tool_call_parser, replicas, max_replicas, prefill_replicas, routing, ray_address,
          replica_cpus, replica_gpus, **engine):
    """Serve ARTIFACT over an OpenAI-compatible HTTP API."""
    sys.modules.setdefault("torch", None)          # as in `run`: the runtime never needs it
    from kiln.artifact import read_manifest
    from kiln.serve.app import ServerConfig
    from kiln.serve.server import serve as run_server
    manifest = read_manifest(artifact, verify=False)
    modules = _lora_modules(lora_modules)
    if (modules or allow_runtime_lora_updating) and manifest.lora is None:
        raise KilnError(f"{artifact} has no LoRA adapter slots: compile it with --max-loras N [--max-lora-rank R]")
    if (modules or allow_runtime_lora_updating) and replicas is not None:
        raise KilnError("LoRA adapters are served by one engine for now: --lora-modules and "
                        "--allow-runtime-lora-updating do not go with --replicas")
    config = ServerConfig(artifact=artifact, engine=_engine_config(**engine), served_model_name=served_model_name,
                          api_key=api_key, reasoning_parser=reasoning_parser, tool_call_parser=tool_call_parser,
                          lora_modules=modules, allow_runtime_lora_updating=allow_runtime_lora_updating)
    on_ray = {"--max-replicas": max_replicas, "--prefill-replicas": prefill_replicas or None,
              "--ray-address": ray_address, "--replica-cpus": replica_cpus, "--replica-gpus": replica_gpus}
    if replicas is None:
        given = [name for name, value in on_ray.items() if value is not None]
        if given or routing != "prefix":
            raise KilnError(f"{', '.join(given) or '--routing'} needs --replicas")
        run_server(config, host, port, drain_timeout)
        return
    if port == 0:
        raise KilnError("--replicas needs a port (Ray Serve's proxy listens on it): give --port")
    from kiln.serve.cluster.app import ClusterConfig, run as run_cluster
    run_cluster(config, ClusterConfig(replicas, max_replicas, prefill_replicas=prefill_replicas, routing=routing,
                                      num_cpus=replica_cpus, num_gpus=replica_gpus), host, port, ray_address)


@main.group()
def bench():
    """Benchmarks."""


@bench.command("serve")
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, help="An OpenAI-compatible server.")
@click.option("--model", default=None, help="Model id (default: the server's first).")
@click.option("--num-prompts", default=100, show_default=True, type=int)
@click.option("--request-rate", default="inf", show_default=True, help="Poisson arrivals per second, or inf.")
@click.option("--max-concurrency", default=None, type=int, help="Requests in flight at most.")
@click.option("--input-len", default=128, show_default=True, type=int)
@click.option("--output-len", default=128, show_default=True, type=int)
@click.option("--dataset", type=click.Choice(["random", "sharegpt-like"]), default="random", show_default=True)
@click.option("--prefix-len", default=0, show_default=True, type=click.IntRange(min=0),
              help="Words of one prefix that every prompt starts with (a shared system prompt).")
@click.option("--api-key", default=None)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--json", "json_path", default=None, help="Also write the report as JSON to this file.")
def bench_serve(url, model, num_prompts, request_rate, max_concurrency, input_len, output_len, dataset, prefix_len,
                api_key, seed, json_path):
    """Load an OpenAI-compatible server and report throughput and latency (as `vllm bench serve`)."""
    import asyncio
    import json
    from kiln.serve.bench import format_report, make_requests, run_benchmark
    rate = float(request_rate)
    if rate <= 0 or num_prompts < 1 or (max_concurrency is not None and max_concurrency < 1):
        raise KilnError("--request-rate, --num-prompts and --max-concurrency must be positive")
    requests = make_requests(num_prompts, input_len, output_len, dataset, seed, prefix_len)
    report = asyncio.run(run_benchmark(url.rstrip("/"), model, requests, rate, max_concurrency, api_key, seed))
    click.echo(format_report(report))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
