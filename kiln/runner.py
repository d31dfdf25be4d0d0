"""`kiln run`: one prompt streamed to stdout (or as JSON), or an interactive chat."""
from __future__ import annotations

import json
import sys
import time

import click

from kiln.artifact import read_manifest
from kiln.errors import KilnError, NoChatTemplate
from kiln.runtime.config import EngineConfig
from kiln.runtime.llm import LLM
from kiln.runtime.threads import describe_threads
from kiln.runtime.tokenizer import Tokenizer


CHAT_CONTEXT = 8192      # tokens of KV cache a chat gets (a conversation's length is not known)


def _open(artifact, config: EngineConfig, size_kv_for: int, params, tokenizer=None):
    # one sequence; a structured output's next mask needs the token before it: no running one step ahead
    return LLM(artifact, config.replace(max_num_seqs=1, overlap=False if params.structured is not None else None),
               size_kv_for=size_kv_for, tokenizer=tokenizer)


def _timings(out, load_seconds: float, threads: int) -> dict:
    m = out.metrics
    n_prompt, n_decode = len(out.prompt_token_ids), len(out.outputs[0].token_ids) - 1
    prefill = m.first_token_time - m.arrival_time
    decode = m.finish_time - m.first_token_time
    return {
        "threads": threads,
        "load_seconds": round(load_seconds, 4),
        "prefill_tokens": n_prompt,
        "cached_prompt_tokens": m.num_cached_tokens,
        "prefill_seconds": round(prefill, 4),
        "prefill_tokens_per_second": round(n_prompt / prefill, 2) if prefill > 0 else None,
        "decode_tokens": n_decode,
        "decode_seconds": round(decode, 4),
        "decode_tokens_per_second": round(n_decode / decode, 2) if decode > 0 and n_decode else None,
    }


def _generate_streaming(llm, prompt_ids, params, echo: bool):
    """Run one request, writing its text to stdout as it comes when `echo`; return its final output."""
    engine = llm.engine
    req = engine.add_request(prompt_ids, params)
    final = None
    try:
        while final is None:
            for out in engine.step():
                if out.request_id != req.request_id:
                    continue
                if echo:
                    sys.stdout.write(out.outputs[0].new_text)
                    sys.stdout.flush()
                if out.finished:
                    final = out
    except KeyboardInterrupt:         # the request goes, its pages with it; the caller decides what next
        engine.abort(req.request_id)
        raise
    if echo:
        sys.stdout.write("\n")
    return final


def run_prompt(artifact, prompt: str, params, config: EngineConfig, as_json: bool) -> None:
    t0 = time.perf_counter()
    read_manifest(artifact, verify=False)       # a missing or broken artifact is named as such first
    tokenizer = Tokenizer(artifact)
    prompt_ids = tokenizer.encode(prompt)
    # The cache this one request needs (its prompt and every token it may write), not a server's.
    llm = _open(artifact, config, len(prompt_ids) + params.max_tokens, params, tokenizer)
    load_seconds = time.perf_counter() - t0
    tiles = llm.model.tiles
    if not as_json:
        click.echo(llm.describe_kv(), err=True)
        if tiles is not None and not tiles.granted:
            click.echo(f"kiln: {tiles.describe()}", err=True)
    out = _generate_streaming(llm, prompt_ids, params, echo=not as_json)
    t = _timings(out, load_seconds, llm.threads)
    done = out.outputs[0]
    if done.finish_reason == "length" and len(done.token_ids) < params.max_tokens:
        click.echo(f"kiln: stopped after {len(done.token_ids)} of --max-tokens {params.max_tokens} tokens: the prompt "
                   f"and the output fill the model's context of {llm.model.max_context} tokens", err=True)
    if as_json:
        print(json.dumps({"prompt": prompt, "prompt_token_ids": out.prompt_token_ids,
                          "output_token_ids": done.token_ids, "text": done.text,
                          "finish_reason": done.finish_reason, "timings": t,
                          "kv_bytes_per_token": llm.model.bytes_per_token, **_speculation(llm),
                          **({"cpu_tiles": tiles.as_json()} if tiles is not None else {})}))
    else:
        def rate(v):
            return f"{v:.1f} tok/s" if v else "n/a"
        click.echo(f"prefill: {t['prefill_tokens']} tokens in {t['prefill_seconds']:.3f}s "
                   f"({rate(t['prefill_tokens_per_second'])}); decode: {t['decode_tokens']} tokens in "
                   f"{t['decode_seconds']:.3f}s ({rate(t['decode_tokens_per_second'])}); "
                   f"{describe_threads(t['threads'])}", err=True)
        spec = _speculation(llm).get("speculative")
        if spec is not None and spec["drafts"]:
            click.echo(f"speculative ({llm.speculative.method}): {spec['accepted_tokens']} of {spec['draft_tokens']} "
                       f"guessed tokens taken ({spec['acceptance_rate']:.0%}), {spec['mean_accepted_length']:.2f} "
                       "tokens per verify step", err=True)


def _speculation(llm) -> dict:
    """The engine's speculative decoding counters, where it speculates (`kiln run --json`)."""
    speculator = llm.engine.speculator
    if speculator is None:
        return {}
    return {"speculative": {"method": llm.speculative.method, "num_speculative_tokens": llm.speculative.num_tokens,
                            **speculator.stats.as_dict()}}


def chat(artifact, params, config: EngineConfig) -> None:
    """Read a line, answer it, repeat, through the model's chat template (a model without one is
    refused: joining the turns by hand would feed it text in a format it was never trained on)."""
    llm = _open(artifact, config, CHAT_CONTEXT, params)
    tok = llm.tokenizer
    if tok.chat_template is None:
        raise NoChatTemplate(f"{artifact} has no chat template (none in chat_template.jinja, tokenizer_config.json "
                             "or chat_template.json), so it cannot chat; give it a prompt with --prompt TEXT")
    click.echo(f"{llm.describe_kv()}; {describe_threads(llm.threads)}", err=True)
    click.echo("kiln chat: type a message, an empty line, Ctrl-D or Ctrl-C to quit (Ctrl-C during a reply stops "
               "the reply).", err=True)
    messages: list[dict] = []
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            click.echo("", err=True)
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)
        try:
            text = _generate_streaming(llm, ids, params, echo=True).outputs[0].text
        except KilnError as e:     # e.g. the conversation outgrew the context: say so, keep the session
            click.echo(f"kiln: {e}", err=True)
            messages.pop()
            continue
        except KeyboardInterrupt:  # the reply is dropped, and so is the message it answered
            click.echo("\n(stopped)", err=True)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": text})
