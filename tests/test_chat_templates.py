"""Tokenizer files of current checkpoints reach the artifact: the chat template wherever the checkpoint
keeps it (chat_template.jinja, chat_template.json, tokenizer_config.json), a SentencePiece-only
tokenizer (converted to tokenizer.json at compile time), and a model without any template."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from kiln.errors import KilnError, NoChatTemplate
from kiln.options import CompileOptions
from kiln.runtime.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEMPLATE = ("{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}[ASSISTANT] {% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there, café?"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye 🙂"}]
WEIGHTS = ("config.json", "model.safetensors", "generation_config.json")


def _model_dir(src, dst, tokenizer_files=("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")):
    dst.mkdir()
    for name in (*WEIGHTS, *tokenizer_files):
        shutil.copy(src / name, dst / name)
    return dst


def _drop_template(model_dir) -> None:
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.pop("chat_template", None)
    path.write_text(json.dumps(config))


def _compile(model_dir, out):
    from kiln.compiler import compile_model
    return compile_model(model_dir, out, CompileOptions(target="cpu"), show=None).to_json()


@pytest.mark.build
def test_chat_template_jinja_saved_by_transformers(make_model, tmp_path):
    src = make_model("llama")
    model = _model_dir(src, tmp_path / "model", tokenizer_files=())
    hf = transformers.AutoTokenizer.from_pretrained(src)
    hf.chat_template = TEMPLATE
    hf.save_pretrained(model)                      # transformers >= 4.50 writes chat_template.jinja
    assert (model / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((model / "tokenizer_config.json").read_text())
    manifest = _compile(model, tmp_path / "art")
    assert "chat_template.jinja" in manifest["tokenizer_files"]
    assert "chat_template.jinja" in manifest["files"]          # checksummed like every file
    expected = transformers.AutoTokenizer.from_pretrained(model).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)
    tok = Tokenizer(tmp_path / "art")
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=True) == expected


@pytest.mark.build
def test_chat_template_json(make_model, tmp_path):
    model = _model_dir(make_model("llama"), tmp_path / "model")
    _drop_template(model)
    (model / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    manifest = _compile(model, tmp_path / "art")
    assert "chat_template.json" in manifest["files"]
    hf = transformers.AutoTokenizer.from_pretrained(model)
    expected = hf.apply_chat_template(MESSAGES, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=False)
    assert Tokenizer(tmp_path / "art").apply_chat_template(MESSAGES, add_generation_prompt=False) == expected


def test_template_precedence(make_model, tmp_path):
    """As transformers: chat_template.jinja, then tokenizer_config.json (a string, or a list whose
    "default" entry counts), then chat_template.json."""
    d = _model_dir(make_model("llama"), tmp_path / "m", ("tokenizer.json", "tokenizer_config.json"))
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "C"}]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "chat_template.json").write_text(json.dumps({"chat_template": "J"}))
    assert Tokenizer(d).chat_template == "C"
    (d / "chat_template.jinja").write_text("F")
    assert Tokenizer(d).chat_template == "F"
    _drop_template(d)
    (d / "chat_template.jinja").unlink()
    assert Tokenizer(d).chat_template == "J"


def test_no_template_is_a_kiln_error(make_model, tmp_path):
    d = _model_dir(make_model("llama"), tmp_path / "m", ("tokenizer.json", "tokenizer_config.json"))
    _drop_template(d)
    tok = Tokenizer(d)
    assert tok.chat_template is None
    with pytest.raises(NoChatTemplate, match="no chat template") as e:
        tok.apply_chat_template(MESSAGES)
    assert isinstance(e.value, KilnError)


@pytest.mark.build
def test_kiln_run_without_prompt_on_a_model_without_template(make_model, tmp_path):
    model = _model_dir(make_model("llama"), tmp_path / "model")
    _drop_template(model)
    _compile(model, tmp_path / "art")
    proc = subprocess.run([sys.executable, "-m", "kiln.cli", "run", str(tmp_path / "art")], input="hello\n",
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("kiln: error:") and "no chat template" in lines[-1] and "--prompt" in lines[-1]
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def _train_sentencepiece(out_dir) -> None:
    spm = pytest.importorskip("sentencepiece")
    pytest.importorskip("google.protobuf")          # transformers' converter reads the model proto
    from kiln.testing.tiny import corpus
    text = out_dir / "corpus.txt"
    text.write_text("\n".join(d.replace("\n", " ") for d in corpus()[:400]))
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(out_dir / "tokenizer"), vocab_size=500,
                                   character_coverage=0.995, model_type="bpe", byte_fallback=True, unk_id=0,
                                   bos_id=1, eos_id=2, minloglevel=2)
    (out_dir / "tokenizer.vocab").unlink()
    text.unlink()
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "chat_template": TEMPLATE}))


@pytest.mark.build
def test_sentencepiece_only_checkpoint_gets_a_tokenizer_json(make_model, tmp_path):
    model = _model_dir(make_model("llama"), tmp_path / "model", tokenizer_files=())
    _train_sentencepiece(model)
    assert not (model / "tokenizer.json").exists()
    with pytest.raises(KilnError, match="tokenizer.model"):
        Tokenizer(model)                               # the runtime alone cannot read it
    manifest = _compile(model, tmp_path / "art")
    assert {"tokenizer.json", "tokenizer.model"} <= set(manifest["files"])
    hf = transformers.AutoTokenizer.from_pretrained(model)
    tok = Tokenizer(tmp_path / "art")
    for text in ("Return the value of the named attribute.", "  two  spaces, café 中文 🙂", ""):
        ids = hf.encode(text)
        assert tok.encode(text) == ids
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert tok.eos_token_ids >= {hf.eos_token_id}
    assert tok.apply_chat_template(MESSAGES) == hf.apply_chat_template(MESSAGES, tokenize=False,
                                                                       add_generation_prompt=True)


TOOL_TEMPLATE = (     # a Hermes-style template: tools in the system turn, calls and results as tagged JSON
    "{% if tools %}<|system|>\nTools:\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|end|>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['role'] == 'tool' %}<tool_response id={{ m['tool_call_id'] }}>{{ m['content'] }}</tool_response>"
    "{% else %}{{ m['content'] or '' }}{% endif %}"
    "{% for call in m.get('tool_calls') or [] %}<tool_call>\n"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}\n</tool_call>"
    "{% endfor %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def test_tools_and_tool_turns_render_as_transformers_renders_them(make_model, tmp_path):
    """What the server sends the template (ChatMessage.for_template: a call's arguments as an object)
    renders as transformers' apply_chat_template(tools=...) does."""
    from kiln.serve.protocol import ChatMessage
    model = tmp_path / "model"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(make_model("llama") / name, model / name)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOL_TEMPLATE}))
    parameters = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city, °C",
                                               "parameters": parameters}}]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}
    wire = [{"role": "user", "content": "Weather in Zürich?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'}]
    ours = Tokenizer(model).apply_chat_template([ChatMessage(**m).for_template() for m in wire], tools=tools)
    hf_messages = [wire[0], {**wire[1], "tool_calls": [{**call, "function": {"name": "get_weather",
                                                                              "arguments": {"city": "Zürich"}}}]},
                   wire[2]]
    want = transformers.AutoTokenizer.from_pretrained(model).apply_chat_template(
        hf_messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert ours == want
    assert '"arguments": {"city": "Zürich"}' in ours and "°C" in ours
