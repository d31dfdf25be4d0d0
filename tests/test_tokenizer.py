"""Tokenizer parity with transformers' AutoTokenizer, chat templates, incremental detokenizing."""

import json
import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from kiln.runtime.tokenizer import IncrementalDetokenizer, Tokenizer

transformers = pytest.importorskip("transformers")

SPECIALS = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}\n"
    "  {% if message['role'] not in ['system', 'user', 'assistant'] %}\n"
    "    {{ raise_exception('unknown role ' + message['role']) }}\n"
    "  {% endif %}\n"
    "  {% if message['role'] == 'system' %}\n"
    "{{ message['content'] | trim }}\n"
    "  {% else %}\n"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "  {% endif %}\n"
    "{% endfor %}\n"
    "{% if tools is not none %}{{ tools | tojson }}{% endif %}\n"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

TEXTS = [
    "Hello world!",
    "  leading and trailing spaces  ",
    "Café crème brûlée, déjà vu.",
    "中文测试：你好，世界。",
    "emoji 🙂 and 🙂🙂 and 👍🏽 mixed",
    "<|user|>hi<|end|></s>",
    "tabs\tand\nnewlines\n\n",
    "",
]

_WORDS = ("the quick brown fox jumps over lazy dog model token kiln compile run serve "
          "café déjà naïve 中文 你好 世界 🙂 hello world").split()


def _corpus(n: int = 400) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12))) + rng.choice(".!?,")
            for _ in range(n)]


def _write_model(path, *, bos_in_post_processor: bool, config_extra: dict) -> None:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if bos_in_post_processor:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False, **config_extra}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


# (bos added by tokenizer.json's post-processor?, extra tokenizer_config.json keys)
VARIANTS = {
    "post_processor_bos": (True, {}),
    "config_add_bos": (False, {"add_bos_token": True}),
    "config_disables_bos": (True, {"add_bos_token": False}),
    "no_bos": (False, {}),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def model_dir(request, tmp_path_factory):
    bos_pp, extra = VARIANTS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    _write_model(path, bos_in_post_processor=bos_pp, config_extra=extra)
    return path


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("plain")
    _write_model(path, bos_in_post_processor=True, config_extra={})
    return path


def _reference(path):
    return transformers.AutoTokenizer.from_pretrained(str(path))


def test_encode_matches_transformers(model_dir):
    ours, ref = Tokenizer(model_dir), _reference(model_dir)
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == \
                ref.encode(text, add_special_tokens=special), (text, special)


def test_bos_added_once(model_dir):
    ours = Tokenizer(model_dir)
    bos = ours.token_to_id("<s>")
    ids = ours.encode("Hello")
    assert ids.count(bos) == int(ours.adds_bos)
    assert ours.adds_bos == (ids[0] == bos)
    assert bos not in ours.encode("Hello", add_special_tokens=False)


def test_decode_matches_transformers(plain_dir):
    ours, ref = Tokenizer(plain_dir), _reference(plain_dir)
    for text in TEXTS:
        ids = ref.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == \
                ref.decode(ids, skip_special_tokens=skip), (text, skip)
        assert ours.decode(ours.encode(text), skip_special_tokens=False).removeprefix("<s>") == text


def test_eos_token_ids(tmp_path, plain_dir):
    ours = Tokenizer(plain_dir)
    assert ours.eos_token_ids == {ours.token_to_id("</s>")}
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((plain_dir / name).read_bytes())
    end = ours.token_to_id("<|end|>")
    for value, expected in ((end, {end}), ([end, 3], {end, 3})):
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
        assert Tokenizer(tmp_path).eos_token_ids == {ours.token_to_id("</s>")} | expected


CONVERSATIONS = [
    [{"role": "user", "content": "Hi there 🙂"}],
    [{"role": "system", "content": "  Be brief.  "},
     {"role": "user", "content": "Qu'est-ce que c'est ?"},
     {"role": "assistant", "content": "中文"},
     {"role": "user", "content": "ok"}],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(plain_dir, add_generation_prompt):
    ours, ref = Tokenizer(plain_dir), _reference(plain_dir)
    for messages in CONVERSATIONS:
        expected = ref.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)
        ours_text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        assert ours_text == expected
    tools = [{"name": "f", "description": "é"}]
    assert ours.apply_chat_template(CONVERSATIONS[0], tools=tools) == \
        ref.apply_chat_template(CONVERSATIONS[0], tools=tools, tokenize=False,
                                add_generation_prompt=True)


def test_chat_template_raise_exception(plain_dir):
    with pytest.raises(Exception, match="unknown role tool"):
        Tokenizer(plain_dir).apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_from_jinja_file(tmp_path, plain_dir):
    (tmp_path / "tokenizer.json").write_bytes((plain_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(tmp_path).apply_chat_template(CONVERSATIONS[0])
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    (tmp_path / "chat_template.jinja").write_text(template)
    assert Tokenizer(tmp_path).apply_chat_template(CONVERSATIONS[0]) == "[Hi there 🙂]"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_detokenizer(plain_dir, skip_special_tokens):
    ours = Tokenizer(plain_dir)
    text = "<|assistant|>Café 中文 🙂👍🏽 déjà vu 你好世界🙂!</s>"
    ids = ours.encode(text)
    detok = IncrementalDetokenizer(ours, skip_special_tokens=skip_special_tokens)
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.flush())
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == ours.decode(ids, skip_special_tokens=skip_special_tokens)
    # The test is only meaningful if some token ends mid-character and is held back.
    assert any("\ufffd" in ours.decode([i]) for i in ids)


def test_incremental_detokenizer_flushes_incomplete_tail(plain_dir):
    ours = Tokenizer(plain_dir)
    ids = ours.encode("ok 🙂", add_special_tokens=False)
    ids = ids[:-1] if "\ufffd" in ours.decode(ids[:-1]) else ids
    detok = IncrementalDetokenizer(ours)
    text = "".join(detok.add(i) for i in ids) + detok.flush()
    assert text == ours.decode(ids)


def test_incremental_detokenizer_with_prompt_context(plain_dir):
    ours = Tokenizer(plain_dir)
    prompt = ours.encode("Hello world")
    completion = ours.encode(" déjà 🙂 vu", add_special_tokens=False)
    detok = IncrementalDetokenizer(ours, prompt_ids=prompt)
    text = "".join(detok.add(i) for i in completion) + detok.flush()
    assert text == ours.decode(prompt + completion)[len(ours.decode(prompt)):]


def test_token_bytes_are_each_tokens_own_bytes(plain_dir):
    """A byte-level BPE token holding part of a UTF-8 character is that part (OpenAI's logprobs
    `bytes`, from which clients rebuild the character), where its text alone is U+FFFD; the tokens'
    bytes join to the text's; transformers' own byte map decodes each token the same way."""
    from kiln.runtime.tokenizer import Tokenizer
    from kiln.serve.responses import Chat
    tok, text = Tokenizer(plain_dir), "é 日本 ok"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.token_bytes(i) for i in ids]
    assert b"".join(pieces) == text.encode("utf-8")
    partial = [i for i, p in zip(ids, pieces) if tok.decode_raw([i]) == "\ufffd"]
    assert partial and all(len(tok.token_bytes(i)) < 3 for i in partial)
    reference = _reference(plain_dir)
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    assert pieces == [bytes(byte_of[c] for c in reference.convert_ids_to_tokens(i)) for i in ids]

    class Body:
        top_logprobs = 1
    entries = Chat(tok, Body(), [[1]], [None], ["r"]).logprobs(None, [partial[0]], [{partial[0]: -0.5}], True)
    assert entries["content"][0]["bytes"] == list(tok.token_bytes(partial[0]))
    assert entries["content"][0]["top_logprobs"][0]["bytes"] == list(tok.token_bytes(partial[0]))
