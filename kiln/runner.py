"""`kiln run`: one prompt streamed to stdout (or as JSON), or an interactive chat."""
from __future__ import annotations

import json
import sys
import time

import click

from kiln.errors import KilnError


def _open(artifact, kv_memory):
    from kiln.runtime.llm import LLM
    t0 = time.perf_counter()
    llm = LLM(artifact, kv_memory=kv_memory, max_num_seqs=1)
    return llm, time.perf_counter() - t0


def _timings(req, load_seconds: float) -> dict:
    prefill = req.first_token_time - req.arrival
    decode = req.finish_time - req.first_token_time
    n_decode = len(req.output_ids) - 1
    return {
        "load_seconds": round(load_seconds, 4),
        "prefill_tokens": len(req.prompt_ids),
        "prefill_seconds": round(prefill, 4),
        "prefill_tokens_per_second": round(len(req.prompt_ids) / prefill, 2) if prefill > 0 else None,
        "decode_tokens": n_decode,
        "decode_seconds": round(decode, 4),
        "decode_tokens_per_second": round(n_decode / decode, 2) if decode > 0 and n_decode else None,
    }


def _generate_streaming(llm, prompt_ids, params, echo: bool):
    from kiln.runtime.tokenizer import IncrementalDetokenizer
    detok = IncrementalDetokenizer(llm.tokenizer, prompt_ids=prompt_ids)
    pieces = []

    def on_token(req, tok):
        if tok in req.eos_ids and not req.params.ignore_eos:
            return
        piece = detok.add(tok)
        pieces.append(piece)
        if echo:
            sys.stdout.write(piece)
            sys.stdout.flush()
    [req] = llm.engine.generate([prompt_ids], params, on_token)
    tail = detok.flush()
    pieces.append(tail)
    if echo:
        sys.stdout.write(tail + "\n")
        sys.stdout.flush()
    return req, "".join(pieces)


def run_prompt(artifact, prompt: str, params, kv_memory, as_json: bool) -> None:
    llm, load_seconds = _open(artifact, kv_memory)
    prompt_ids = llm.tokenizer.encode(prompt)
    if not as_json:
        click.echo(llm.describe_kv(), err=True)
    req, text = _generate_streaming(llm, prompt_ids, params, echo=not as_json)
    t = _timings(req, load_seconds)
    if as_json:
        print(json.dumps({"prompt": prompt, "prompt_token_ids": req.prompt_ids, "output_token_ids": req.output_ids,
                          "text": text, "finish_reason": req.finish_reason, "timings": t}))
    else:
        rate = lambda v: f"{v:.1f} tok/s" if v else "n/a"
        click.echo(f"prefill: {t['prefill_tokens']} tokens in {t['prefill_seconds']:.3f}s "
                   f"({rate(t['prefill_tokens_per_second'])}); decode: {t['decode_tokens']} tokens in "
                   f"{t['decode_seconds']:.3f}s ({rate(t['decode_tokens_per_second'])})", err=True)


def chat(artifact, params, kv_memory) -> None:
    """Read a line, answer it, repeat; uses the model's chat template when it has one."""
    llm, _ = _open(artifact, kv_memory)
    tok = llm.tokenizer
    click.echo(llm.describe_kv(), err=True)
    click.echo("kiln chat: type a message, an empty line or Ctrl-D to quit.", err=True)
    messages: list[dict] = []
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        if tok.chat_template:
            ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)
        else:
            ids = tok.encode("\n".join(m["content"] for m in messages))
        try:
            req, text = _generate_streaming(llm, ids, params, echo=True)
        except KilnError as e:     # e.g. the conversation outgrew the context: say so, keep the session
            click.echo(f"kiln: {e}", err=True)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": text})
