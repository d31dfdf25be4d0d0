"""The kiln command: one clear line and exit code 2 for bad input; run/inspect on a real artifact."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from kiln.runtime.config import EngineConfig

KILN = [sys.executable, "-m", "kiln.cli"]


def as_from_a_terminal():
    """A child's SIGINT as a terminal's Ctrl-C finds it (a suite started as a background job of a
    shell hands its children SIGINT ignored, and Python then installs no KeyboardInterrupt)."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def kiln(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*KILN, *map(str, args)], capture_output=True, text=True, timeout=600, **kw)


def assert_clean_error(proc, *words):
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr
    assert lines[-1].startswith("kiln: error:"), proc.stderr
    for w in words:
        assert w in lines[-1], (w, lines[-1])


@pytest.fixture(scope="module")
def artifact(llama_cpu):
    """The tiny Llama's CPU artifact (`kiln compile`'s own output is checked in test_compile_output.py)."""
    return llama_cpu[0]


def test_missing_model_directory(tmp_path):
    assert_clean_error(kiln("compile", tmp_path / "nope", "-o", tmp_path / "a"), "does not exist")


def test_missing_config_field(make_model, tmp_path):
    src = make_model("llama")
    model = tmp_path / "m"
    shutil.copytree(src, model)
    cfg = json.loads((model / "config.json").read_text())
    del cfg["num_attention_heads"]
    (model / "config.json").write_text(json.dumps(cfg))
    assert_clean_error(kiln("compile", model, "-o", tmp_path / "a"), "num_attention_heads")


def test_unknown_architecture(make_model, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(make_model("llama"), model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (model / "config.json").write_text(json.dumps(cfg))
    assert_clean_error(kiln("compile", model, "-o", tmp_path / "a"), "GPTNeoXForCausalLM", "not supported")


def test_unknown_target(make_model, tmp_path):
    assert_clean_error(kiln("compile", make_model("llama"), "--target", "tpu", "-o", tmp_path / "a"), "tpu")


def test_quantisation_a_target_cannot_run_is_refused(make_model, tmp_path):
    flags = ["--target", "cuda", "--arch", "sm_80", "--quant", "fp8"]
    assert_clean_error(kiln("compile", make_model("llama"), *flags, "-o", tmp_path / "a"), "--quant fp8", "sm_80",
                       "q8, q4")


@pytest.mark.parametrize("target", ["rocm", "metal"])
def test_a_kv_cache_a_target_cannot_read_is_refused(target):
    """ROCm and Metal attention reads only unquantised pages (CUDA and the CPU read int8 and fp8)."""
    from kiln.errors import KilnError
    from kiln.targets import target_defaults
    with pytest.raises(KilnError, match=f"--kv-dtype int8 is not supported on target {target} .*unquantised"):
        target_defaults(target).check_quant(None, "int8")


def test_corrupted_weight_file(make_model, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(make_model("llama"), model)
    weights = model / "model.safetensors"
    weights.write_bytes(b"\x00garbage" + weights.read_bytes()[:1000])
    assert_clean_error(kiln("compile", model, "-o", tmp_path / "a"), "model.safetensors")


def test_debug_flag_shows_the_traceback(tmp_path):
    proc = kiln("--debug", "compile", tmp_path / "nope", "-o", tmp_path / "a")
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_inspect_summarises_the_artifact(artifact):
    proc = kiln("inspect", artifact)
    assert proc.returncode == 0, proc.stderr
    for word in ("LlamaForCausalLM", "target     cpu", "paged_attention", "weights.safetensors", "model.cpu.so"):
        assert word in proc.stdout
    # what each pass did, in the ops it changed; the passes with nothing to do on a Llama named as such
    assert "weights not quantised (float32); KV cache float32 (not quantised)" in proc.stdout
    passes = proc.stdout[proc.stdout.index("passes     "):proc.stdout.index("compile    ")]
    assert "fuse_qkv: linear −4, slice +6" in passes, passes           # 2 layers: 3 linears -> 1 + 3 slices
    assert "select_kernels: " in passes and "nodes or params new or rewritten" in passes
    assert "nothing to do here: " in passes and "specialize_mla" in passes.split("nothing to do here: ")[1]
    assert "specialize_mla:" not in passes and "→" not in passes


def test_run_json(artifact):
    proc = kiln("run", artifact, "--prompt", "def main():", "--max-tokens", "6", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["output_token_ids"]) == 6 and out["prompt_token_ids"]
    assert out["timings"]["decode_tokens_per_second"] > 0
    assert out["finish_reason"] in ("length", "stop")
    manifest = json.loads((artifact / "manifest.json").read_text())
    c = manifest["model"]["config"]        # every layer's k and v rows, in the model dtype
    width = {"float32": 4, "bfloat16": 2}[manifest["dtype"]]
    assert out["kv_bytes_per_token"] == c["num_layers"] * 2 * c["num_kv_heads"] * c["head_dim"] * width


def test_run_json_schema(artifact, tmp_path):
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "rain"],
              "properties": {"city": {"type": "string", "maxLength": 10}, "rain": {"type": "boolean"}}}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    proc = kiln("run", artifact, "--prompt", "Weather?", "--max-tokens", "80", "--temperature", "1", "--seed", "1",
                "--json-schema", str(tmp_path / "schema.json"), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    answer = json.loads(out["text"])
    assert out["finish_reason"] == "stop" and set(answer) == {"city", "rain"} and len(answer["city"]) <= 10
    (tmp_path / "bad.json").write_text('{"type": "strin"}')
    assert_clean_error(kiln("run", artifact, "--prompt", "x", "--json-schema", str(tmp_path / "bad.json")),
                       "json schema", "strin")


def _run_threads(artifact, *flags, **env) -> int:
    environ = {k: v for k, v in os.environ.items() if k != "TVM_NUM_THREADS"} | env
    proc = kiln("run", artifact, "--prompt", "def", "--max-tokens", "2", "--json", *flags, env=environ)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["timings"]["threads"]


def test_run_uses_every_core_unless_told_otherwise(artifact):
    """--threads, then $TVM_NUM_THREADS, then every core the process may run on."""
    assert _run_threads(artifact) == len(os.sched_getaffinity(0))
    assert _run_threads(artifact, "--threads", "1") == 1
    assert _run_threads(artifact, TVM_NUM_THREADS="1") == 1
    assert _run_threads(artifact, "--threads", "2", TVM_NUM_THREADS="1") == 2


def test_tvm_takes_the_thread_count():
    """The count reaches TVM's pool, in the calling thread and in threads made later."""
    code = ("import threading, tvm; from kiln.runtime.threads import set_threads; n = set_threads(); "
            "seen = []; t = threading.Thread(target=lambda: seen.append(tvm.runtime.num_threads())); "
            "t.start(); t.join(); print(n, tvm.runtime.num_threads(), seen[0])")
    env = {k: v for k, v in os.environ.items() if k != "TVM_NUM_THREADS"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(len(os.sched_getaffinity(0)))] * 3


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a machine with two cores or more")
def test_fewer_threads_than_cores_leave_the_process_every_core():
    """TVM binds the calling thread to the first core when its pool shrinks to one thread: two such
    processes (test workers, servers) would share that core, and every child they start would too."""
    code = ("import os; from kiln.runtime.threads import set_threads; set_threads(); set_threads(1); "
            "print(sorted(os.sched_getaffinity(0)))")
    env = {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", "TVM_BIND_THREADS")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(sorted(os.sched_getaffinity(0)))


def test_run_streams_text_and_prints_throughput(artifact):
    proc = kiln("run", artifact, "--prompt", "import os", "--max-tokens", "8", "--temperature", "0.7",
                "--top-p", "0.9", "--top-k", "40", "--seed", "3")
    assert proc.returncode == 0, proc.stderr
    assert "prefill:" in proc.stderr and "tok/s" in proc.stderr


def test_run_chat_reads_stdin(artifact):
    proc = kiln("run", artifact, "--max-tokens", "4", input="hello there\n\n")
    assert proc.returncode == 0, proc.stderr
    assert "kiln chat" in proc.stderr


def test_artifact_with_corrupted_file(artifact, tmp_path):
    broken = tmp_path / "a"
    shutil.copytree(artifact, broken)
    weights = broken / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert_clean_error(kiln("run", broken, "--prompt", "x"), "checksum mismatch", "weights.safetensors")


def test_artifact_with_missing_file(artifact, tmp_path):
    broken = tmp_path / "a"
    shutil.copytree(artifact, broken)
    (broken / "model.cpu.so").unlink()
    assert_clean_error(kiln("run", broken, "--prompt", "x"), "model.cpu.so", "missing")


def test_artifact_with_wrong_interface_version(artifact, tmp_path):
    broken = tmp_path / "a"
    shutil.copytree(artifact, broken)
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest["interface_version"] = 999
    (broken / "manifest.json").write_text(json.dumps(manifest))
    assert_clean_error(kiln("run", broken, "--prompt", "x"), "interface version 999")


@pytest.mark.build
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_in_the_build_phase_stops_the_compile_cleanly(make_model, tmp_path, sig):
    """SIGINT or SIGTERM while TVM builds (its FFI turns KeyboardInterrupt into a RuntimeError): the
    compile stops as in every other phase, no traceback, nothing left at -o or beside it; Ctrl-C with
    click's one line and exit 1, SIGTERM with exit 143 (128 + 15)."""
    import shutil
    import signal
    import time
    out = tmp_path / "a"
    for _ in range(3):      # the build takes about a second: a loaded machine may delay this reader past it
        proc = subprocess.Popen([*KILN, "compile", str(make_model("llama")), "-o", str(out)], stderr=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, text=True, preexec_fn=as_from_a_terminal)
        seen = []
        for line in proc.stderr:              # a phase's line comes when it ends: build is next after codegen
            seen.append(line)
            if line.strip().startswith("codegen"):
                time.sleep(0.1)
                proc.send_signal(getattr(signal, sig))
                break
        rest = proc.stderr.read()
        code = proc.wait(timeout=120)
        if not any(line.strip().startswith("build") for line in rest.splitlines()):
            break
        shutil.rmtree(out, ignore_errors=True)     # the build had finished before the signal came: again
    assert code == (1 if sig == "SIGINT" else 143), "".join(seen) + rest
    assert "Traceback" not in rest, rest
    if sig == "SIGINT":
        assert rest.strip().splitlines()[-1] == "Aborted!", rest
    assert not any(line.strip().startswith("build") for line in rest.splitlines()), "the build finished first"
    assert not out.exists() and not list(tmp_path.glob("a*"))


def test_chat_ctrl_c_stops_the_reply_and_the_session_goes_on(artifact, monkeypatch, capsys):
    """Ctrl-C during a reply: the request is aborted, the turn dropped, the next line answered; Ctrl-C
    at the prompt ends the chat (`kiln run` then exits 0)."""
    import builtins
    from kiln import runner
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampler import SamplingParams
    llm = LLM(artifact, kv_memory="16MiB", max_num_seqs=1)
    real_step, steps = llm.engine.step, []

    def step():
        steps.append(1)
        if len(steps) == 2:                   # the first reply, after its prefill
            raise KeyboardInterrupt
        return real_step()
    monkeypatch.setattr(llm.engine, "step", step)
    monkeypatch.setattr(runner, "_open", lambda *a, **k: llm)
    lines = iter(["first question", "second question"])

    def answer(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise KeyboardInterrupt from None
    monkeypatch.setattr(builtins, "input", answer)
    runner.chat(artifact, SamplingParams(max_tokens=4), EngineConfig(kv_memory="16MiB"))
    err = capsys.readouterr().err
    assert "(stopped)" in err and not llm.engine.has_unfinished()
    assert len(steps) > 3                     # the second question was answered


def test_chat_ends_with_exit_0_on_ctrl_c_or_ctrl_d_at_the_prompt(artifact):
    import signal
    import time
    proc = subprocess.Popen([*KILN, "run", str(artifact), "--max-tokens", "2"], stdin=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if line.startswith("kiln chat"):
            break
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Aborted" not in err and "Traceback" not in err, err
    ended = kiln("run", artifact, "--max-tokens", "2", input="")          # Ctrl-D: end of input
    assert ended.returncode == 0, ended.stderr


def test_ctrl_c_that_tvm_turned_into_an_error_is_still_a_ctrl_c(tmp_path):
    """TVM's FFI turns a KeyboardInterrupt raised under a C++ call (a Python callback the build runs)
    into a bare RuntimeError; kiln's commands still stop as on any Ctrl-C: click's one line, exit 1."""
    script = tmp_path / "interrupted.py"
    script.write_text(
        "import os, signal, time\n"
        "import click, tvm_ffi\n"
        "from kiln.cli import _Main\n"
        "@tvm_ffi.register_global_func('kiln_test.interrupted')\n"
        "def callback():\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(1)\n"
        "@click.group(cls=_Main)\n"
        "@click.option('--debug', is_flag=True)\n"
        "def group(debug):\n"
        "    pass\n"
        "@group.command()\n"
        "def build():\n"
        "    tvm_ffi.get_global_func('kiln_test.interrupted')()\n"
        "group(['build'])\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          preexec_fn=as_from_a_terminal)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "Aborted!"


def test_a_run_stopped_by_the_context_says_so(artifact, capsys):
    """--max-tokens past what the context leaves: the output stops at the context, and stderr says why."""
    from kiln.runner import run_prompt
    from kiln.runtime.sampler import SamplingParams
    context = json.loads((artifact / "manifest.json").read_text())["max_context"]
    run_prompt(artifact, "hello there", SamplingParams(max_tokens=context + 100, ignore_eos=True), EngineConfig(), True)
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["finish_reason"] == "length" and len(out["prompt_token_ids"]) + len(out["output_token_ids"]) == context
    assert f"the model's context of {context} tokens" in captured.err and str(context + 100) in captured.err


def test_kv_memory_as_a_fraction_on_the_cpu(artifact):
    proc = kiln("run", artifact, "--prompt", "hi", "--max-tokens", "2", "--kv-memory", "0.05")
    assert proc.returncode == 0, proc.stderr


def test_version():
    proc = kiln("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == "kiln 0.1.0", proc.stdout + proc.stderr


def test_a_file_where_a_directory_belongs_is_named_as_such(tmp_path):
    stray = tmp_path / "model.safetensors"
    stray.write_bytes(b"\0")
    assert_clean_error(kiln("compile", stray, "-o", tmp_path / "a"), "is a file", "model directory")
    assert_clean_error(kiln("run", stray, "--prompt", "x"), "is a file", "kiln compile -o")


def test_running_a_model_directory_says_to_compile_it_first(make_model):
    model = make_model("llama")
    assert_clean_error(kiln("run", model, "--prompt", "x"), "Hugging Face model directory", f"kiln compile {model}")


def test_an_output_path_that_cannot_be_made_is_one_plain_line(make_model):
    proc = kiln("compile", make_model("llama"), "-o", "/proc/nope/x")
    assert_clean_error(proc, "cannot create the artifact directory /proc/nope/x", "No such file or directory")
    assert "[Errno" not in proc.stderr


def test_a_job_longer_than_the_context_sizes_the_cache_for_the_context(artifact):
    """The chat sizes its cache for 8,192 tokens: on a model of a shorter context, the KV line speaks
    of the context, not of more tokens than the model can hold."""
    from kiln.runtime.llm import LLM
    llm = LLM(artifact, kv_memory="auto", max_num_seqs=1, size_kv_for=10**6)
    context, line = llm.model.max_context, llm.describe_kv()
    assert f"sized for {context} tokens" in line and str(10**6) not in line, line
