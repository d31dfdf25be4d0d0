"""`kiln serve` with LoRA adapters (vLLM's surface), driven by the official `openai` client and raw HTTP:
`model` picks an adapter and the answer is the offline API's on it, /v1/models lists adapters under their
parent, adapters load and unload at run time, bad adapters get their 4xx, and 16 adapters over 4 slots
under 16 concurrent clients leave no request failed and no page or slot held."""
from __future__ import annotations

import asyncio
import random
import re
import shutil
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("peft")

from serving import KEY, running_server  # noqa: E402
from test_lora import ADAPTERS, make_adapter  # noqa: E402

pytestmark = pytest.mark.build
ADAPTER_COUNT = 16                   # names served: the 4 PEFT adapters, each under 4 names


@pytest.fixture(scope="module")
def setup(make_model, tmp_path_factory):
    from artifact_cache import cpu_artifact
    model_dir = make_model("llama")
    root = tmp_path_factory.mktemp("serve-lora")
    made = [make_adapter(model_dir, root / f"peft{i}", 20 + i, *spec) for i, spec in enumerate(ADAPTERS)]
    folders = {f"lora{k}": made[k % len(made)] for k in range(ADAPTER_COUNT)}
    link = root / "tiny-llama"
    link.symlink_to(cpu_artifact(model_dir, max_loras=4, max_lora_rank=16), target_is_directory=True)
    return link, folders, made


@pytest.fixture(scope="module")
def server(setup, tmp_path_factory):
    artifact, folders, _ = setup
    modules = [arg for name, folder in folders.items() for arg in ("--lora-modules", f"{name}={folder}")]
    log = tmp_path_factory.mktemp("serve-lora-log") / "server.log"
    with running_server(artifact, log, *modules, "--allow-runtime-lora-updating", "--kv-memory", "32MiB",
                        "--max-num-seqs", "16") as (url, _):
        yield url


def post(server, path, body):
    return httpx.post(f"{server}{path}", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def metric_text(server) -> str:
    return httpx.get(f"{server}/metrics").text


def test_models_lists_each_adapter_under_its_parent(server, setup):
    _, folders, _ = setup
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY)
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == ["tiny-llama", *folders]
    assert cards["lora3"].parent == "tiny-llama" and cards["lora3"].root == str(folders["lora3"])
    assert client.models.retrieve("lora5").parent == "tiny-llama"


def test_model_picks_the_adapter_and_answers_as_the_offline_api(server, setup):
    from kiln.runtime.llm import LLM
    from kiln.runtime.lora import LoRARequest
    from kiln.runtime.sampler import SamplingParams
    artifact, folders, _ = setup
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY)
    llm = LLM(artifact, kv_memory="16MiB")
    prompt = [5, 17, 99, 230, 41, 7, 300]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    texts = {}
    for k, name in enumerate(("tiny-llama", "lora0", "lora1", "lora2")):
        got = client.completions.create(model=name, prompt=prompt, max_tokens=10, temperature=0.0,
                                        extra_body={"ignore_eos": True})
        lora = None if name == "tiny-llama" else LoRARequest(name, k, str(folders[name]))
        want = llm.generate([prompt], greedy, use_tqdm=False, lora_request=lora)[0].outputs[0].text
        assert got.choices[0].text == want and got.model == name
        texts[name] = want
    assert len(set(texts.values())) == len(texts)                 # every adapter answers otherwise
    chunks = list(client.chat.completions.create(model="lora1", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, stream=True))
    assert chunks and all(c.model == "lora1" for c in chunks)


def test_unknown_models_and_bad_adapters_get_their_4xx(server, setup, tmp_path):
    _, _, made = setup
    missing = post(server, "/v1/completions", {"model": "lora99", "prompt": "x", "max_tokens": 2})
    assert missing.status_code == 404 and "lora99" in missing.json()["error"]["message"]
    gone = post(server, "/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": str(tmp_path / "none")})
    assert gone.status_code == 400 and "cannot read" in gone.json()["error"]["message"]
    taken = post(server, "/v1/load_lora_adapter", {"lora_name": "lora1", "lora_path": str(made[0])})
    assert taken.status_code == 400 and "is taken" in taken.json()["error"]["message"]
    wide = shutil.copytree(made[0], tmp_path / "wide")
    (wide / "adapter_config.json").write_text((wide / "adapter_config.json").read_text().replace('"r": 8', '"r": 9'))
    bad = post(server, "/v1/load_lora_adapter", {"lora_name": "wide", "lora_path": str(wide)})
    assert bad.status_code == 400 and "its config says 9" in bad.json()["error"]["message"]
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "nope"}).status_code == 404
    assert post(server, "/v1/completions", {"model": "lora1", "prompt": "x", "max_tokens": 2}).status_code == 200


def test_adapters_load_and_unload_at_run_time(server, setup):
    _, _, made = setup
    loaded = post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(made[2])})
    assert loaded.status_code == 200 and "late" in loaded.text
    answer = post(server, "/v1/completions", {"model": "late", "prompt": [3, 4, 5], "max_tokens": 3})
    assert answer.status_code == 200 and answer.json()["model"] == "late"
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 200
    assert post(server, "/v1/completions", {"model": "late", "prompt": "x", "max_tokens": 2}).status_code == 404


def test_sixteen_clients_over_sixteen_adapters_on_four_slots(server, setup):
    """16 concurrent clients, each sending requests to adapters at random (and the base model): none fails;
    afterwards no KV page is held and vllm:lora_requests_info shows no adapter running or waiting."""
    _, folders, _ = setup
    names = ["tiny-llama", *folders]
    results = {"ok": 0, "failed": 0}
    seen = set()

    async def one_client(i, http):
        rng = random.Random(i)
        for _ in range(4):
            name = rng.choice(names)
            body = {"model": name, "prompt": [rng.randrange(3, 500) for _ in range(rng.randrange(4, 40))],
                    "max_tokens": rng.randrange(4, 24), "stream": rng.random() < 0.5}
            r = await http.post("/v1/completions", json=body)
            results["ok" if r.status_code == 200 and "data: [DONE]" in r.text or not body["stream"]
                    and r.status_code == 200 else "failed"] += 1
            seen.add(name)

    async def main():
        async with httpx.AsyncClient(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                                     limits=httpx.Limits(max_connections=32)) as http:
            await asyncio.gather(*(one_client(i, http) for i in range(16)))

    asyncio.run(main())
    assert results == {"ok": 64, "failed": 0} and len(seen) > 10, (results, seen)
    deadline = time.time() + 20
    while time.time() < deadline and re.search(r"^kiln_kv_pages_used 0\.0$", metric_text(server), re.M) is None:
        time.sleep(0.2)
    text = metric_text(server)
    assert re.search(r"^kiln_kv_pages_used 0\.0$", text, re.M)
    info = re.search(r'^vllm:lora_requests_info{(.*)} \S+$', text, re.M).group(1)
    assert 'max_lora="4"' in info and 'running_lora_adapters=""' in info and 'waiting_lora_adapters=""' in info


def test_serve_refuses_adapters_it_cannot_serve_in_one_line(llama_cpu, setup, tmp_path):
    from click.testing import CliRunner
    from kiln.cli import main
    artifact, folders, _ = setup
    cases = [([str(llama_cpu[0]), "--lora-modules", f"a={folders['lora0']}"], "has no LoRA adapter slots"),
             ([str(artifact), "--lora-modules", "a"], "give NAME=PATH"),
             ([str(artifact), "--lora-modules", f"a={tmp_path}"], "holds no adapter_config.json"),
             ([str(artifact), "--lora-modules", f"a={folders['lora0']}", "--replicas", "2"], "do not go with --replicas")]
    for args, message in cases:
        result = CliRunner().invoke(main, ["serve", *args])
        assert result.exit_code == 2 and message in result.output, (args, result.output)
