"""Tool calls from a trained small model: how many replies to a tool-calling prompt set are
well-formed calls (they parse, and their arguments validate against the function's parameters),
with tool_choice "required" (the grammar of serve/tool_calls.py) and, for contrast, with "auto"
(the model alone).

    python bench/tool_calls_cpu.py [--workdir build/bench/tool-calls] [--minutes 6] [--prompts 60]

The model is bench/train_small.py's (trained here on stdlib docstrings when the workdir has none):
it has never seen a tool call, so what "required" gets right is the grammar's doing, and "auto"
shows the model's own rate. Prompts ask for one of three functions (weather, unit conversion,
time zones) with varied arguments; each is rendered by the model's chat template with the tools,
as the server renders it; replies are sampled at temperature 0.7 with a seed per prompt, in the
hermes syntax. Requests go through kiln.LLM, the engine the server runs.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from kiln.options import CompileOptions

ZONE = {"type": "string", "pattern": "^[A-Z][a-z]{1,12}/[A-Z][a-z]{1,12}$"}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city.",
                                      "parameters": {"type": "object", "additionalProperties": False,
                                                     "required": ["city", "days"],
                                                     "properties": {"city": {"type": "string", "maxLength": 24},
                                                                    "days": {"type": "integer", "minimum": 1,
                                                                             "maximum": 14}}}}},
    {"type": "function", "function": {"name": "convert_units", "description": "Convert a quantity.",
                                      "parameters": {"type": "object", "additionalProperties": False,
                                                     "required": ["value", "from_unit", "to_unit"],
                                                     "properties": {"value": {"type": "number"},
                                                                    "from_unit": {"enum": ["km", "mi", "kg", "lb"]},
                                                                    "to_unit": {"enum": ["km", "mi", "kg", "lb"]}}}}},
    {"type": "function", "function": {"name": "current_time", "description": "The time in a time zone.",
                                      "parameters": {"type": "object", "additionalProperties": False,
                                                     "required": ["zone"], "properties": {"zone": ZONE}}}},
]
CITIES = ["Oslo", "Lima", "Kyoto", "Accra", "Quito", "Perth", "Bern", "Hanoi", "Tunis", "Sofia"]


def prompts(count: int) -> list[str]:
    out = []
    for i in range(count):
        city, n = CITIES[i % len(CITIES)], 1 + i % 9
        out.append([f"What will the weather be in {city} for the next {n} days?",
                    f"How many kilometres is {3 * i + 2} miles?",
                    f"What time is it now in Europe/{city}?"][i % 3])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, default=Path("build/bench/tool-calls"))
    ap.add_argument("--minutes", type=float, default=6.0, help="training time when the workdir has no model")
    ap.add_argument("--prompts", type=int, default=60)
    args = ap.parse_args()
    model_dir = args.workdir / "model"
    if not (model_dir / "config.json").exists():
        subprocess.run([sys.executable, str(Path(__file__).with_name("train_small.py")), str(model_dir),
                        "--minutes", str(args.minutes)], check=True)
    import jsonschema_rs
    from kiln.compiler import compile_model
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampler import SamplingParams
    from kiln.serve.tool_calls import FORMATS, parse, structural_tag
    artifact = args.workdir / "artifact"
    if not (artifact / "manifest.json").exists():
        compile_model(model_dir, artifact, CompileOptions(target="cpu"), show=None, force=True)
    llm = LLM(artifact, kv_memory="256MiB", overlap=False)
    fmt = FORMATS["hermes"]
    schemas = {t["function"]["name"]: jsonschema_rs.validator_for(t["function"]["parameters"]) for t in TOOLS}
    texts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], tools=TOOLS)
             for p in prompts(args.prompts)]
    ids = [llm.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    rows = []
    for choice in ("required", "auto"):
        grammar = structural_tag(fmt, TOOLS, None, parallel=False) if choice == "required" else None
        params = [SamplingParams(temperature=0.7, seed=i, max_tokens=120, structured=grammar,
                                 skip_special_tokens=False) for i in range(len(ids))]
        t0 = time.perf_counter()
        outs = llm.generate(ids, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        good = 0
        for out in outs:
            _, calls = parse(fmt, out.outputs[0].text)
            good += bool(calls) and all(c.name in schemas and schemas[c.name].is_valid(json.loads(c.arguments))
                                        for c in calls)
        rows.append((choice, good, len(outs), seconds))
    print(f"\n{args.prompts} tool-calling prompts, 3 functions, hermes syntax, temperature 0.7; model: "
          f"bench/train_small.py's ({model_dir})")
    print("| tool_choice | well-formed calls | share | seconds |")
    print("|---|---|---|---|")
    for choice, good, total, seconds in rows:
        print(f"| {choice} | {good} / {total} | {good / total:.0%} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
