"""Train a small Llama on text from Python's standard library, so quantisation error can be
measured on a model whose weights mean something (random weights amplify every error).

    python bench/train_small.py OUT [--minutes 6] [--vocab 2048] [--tie-embeddings]
                                [--hidden 512 --layers 8] [--draft DRAFT_OUT --draft-minutes 4]

The corpus is kiln.testing.tiny.corpus() (the docstrings of ~60 stdlib modules, ~0.5 MB); every 20th
document is held out and written to OUT/heldout.json for evaluation. Architecture: Llama with
GQA (8 query / 2 KV heads), 4 layers, hidden 256, untied LM head (--tie-embeddings: tied, as in
Llama-3.2). --hidden and --layers make it larger (the MLP stays 3x hidden, heads 64 wide). Training:
AdamW, sequences of 128 tokens, a cosine learning-rate schedule over the time budget. Prints the
held-out loss.

--copy F makes that share of the training rows copies: a stretch of 24 to 64 tokens, then the same
stretch again, then what followed it. Larger models learn to quote the text they are given; one
this small and this briefly trained does not without being shown, and prompt-lookup speculation
(bench/speculative.py) measures what a model that quotes gains.

--draft DRAFT_OUT also trains a draft for speculative decoding (the default architecture) on the same
tokenizer and the same data, and saves it there with its own copy of the tokenizer.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

CONFIG = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, rms_norm_eps=1e-5,
              rope_theta=10000.0, tie_word_embeddings=False)
SEQ, BATCH = 128, 16


def split_corpus():
    from kiln.testing.tiny import corpus
    docs = corpus()
    return [d for i, d in enumerate(docs) if i % 20], [d for i, d in enumerate(docs) if i % 20 == 0]


def token_stream(tok, docs) -> list[int]:
    ids: list[int] = []
    for d in docs:
        ids += tok.encode(d).ids          # each document starts with <s>
    return ids


def heldout_loss(model, ids, torch) -> float:
    model.eval()
    with torch.no_grad():
        n = (len(ids) - 1) // SEQ
        x = torch.tensor(ids[:n * SEQ + 1])
        losses = [model(input_ids=x[i * SEQ:(i + 1) * SEQ][None], labels=x[i * SEQ:(i + 1) * SEQ][None]).loss.item()
                  for i in range(n)]
    model.train()
    return sum(losses) / len(losses)


def batch_rows(data, copy: float, torch):
    """BATCH rows of SEQ tokens from random places in `data`; a `copy` share of them repeat a stretch."""
    starts = torch.randint(0, len(data) - SEQ - 1, (BATCH,))
    rows = []
    for s in starts.tolist():
        if torch.rand(()).item() < copy:
            span = int(torch.randint(24, 65, ()).item())
            stretch = data[s:s + span]
            rows.append(torch.cat([stretch, stretch, data[s + span:s + SEQ - span]]))
        else:
            rows.append(data[s:s + SEQ])
    return torch.stack(rows)


def train(config, train_ids, held_ids, minutes: float, out: Path, torch, transformers, copy: float = 0.0) -> None:
    """Train a LlamaForCausalLM of `config` for `minutes` and save it (and its held-out loss) in `out`."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    data = torch.tensor(train_ids)
    budget, t0, step = minutes * 60, time.perf_counter(), 0
    print(f"{out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {len(train_ids)} training "
          f"tokens, {len(held_ids)} held out; loss before training {heldout_loss(model, held_ids, torch):.3f}")
    while (elapsed := time.perf_counter() - t0) < budget:
        lr = 3e-3 * (min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * elapsed / budget)))
        for group in opt.param_groups:
            group["lr"] = lr
        batch = batch_rows(data, copy, torch)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 100 == 0:
            print(f"step {step}: train loss {loss.item():.3f} ({elapsed:.0f}s)", flush=True)
    held = heldout_loss(model, held_ids, torch)
    print(f"{step} steps in {time.perf_counter() - t0:.0f}s; held-out loss {held:.3f} (perplexity {math.exp(held):.1f})")
    model.eval().save_pretrained(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--minutes", type=float, default=6.0)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=None, help="hidden size (default 256)")
    ap.add_argument("--layers", type=int, default=None, help="layers (default 4)")
    ap.add_argument("--draft", type=Path, default=None, help="also train a draft model (the default size) here")
    ap.add_argument("--draft-minutes", type=float, default=4.0)
    ap.add_argument("--copy", type=float, default=0.0, help="share of training rows that repeat a stretch")
    ap.add_argument("--tie-embeddings", action="store_true", help="the LM head is the embedding table")
    args = ap.parse_args()
    import torch
    import transformers
    from tokenizers import Tokenizer
    from kiln.testing.tiny import BOS, EOS, train_tokenizer
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    out = args.out
    train_tokenizer(out, vocab_size=args.vocab)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    train_docs, held_docs = split_corpus()
    train_ids, held_ids = token_stream(tok, train_docs), token_stream(tok, held_docs)
    size = {} if args.hidden is None else dict(hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                                               num_attention_heads=args.hidden // 64, head_dim=64)
    special = dict(vocab_size=tok.get_vocab_size(), bos_token_id=tok.token_to_id(BOS), eos_token_id=tok.token_to_id(EOS))
    config = transformers.LlamaConfig(**{**CONFIG, **size, "tie_word_embeddings": args.tie_embeddings,
                                         "num_hidden_layers": args.layers or CONFIG["num_hidden_layers"]}, **special)
    train(config, train_ids, held_ids, args.minutes, out, torch, transformers, args.copy)
    (out / "heldout.json").write_text(json.dumps(held_docs))
    if args.draft is not None:
        args.draft.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (out / name).exists():
                shutil.copy(out / name, args.draft / name)
        draft_config = transformers.LlamaConfig(**{**CONFIG, "tie_word_embeddings": args.tie_embeddings}, **special)
        train(draft_config, train_ids, held_ids, args.draft_minutes, args.draft, torch, transformers, args.copy)


if __name__ == "__main__":
    main()
