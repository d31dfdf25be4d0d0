"""A baseline OpenAI-compatible server: HF transformers, one request at a time (no batching).

    python bench/hf_server.py MODEL_DIR [--port 8001] [--threads N]

Serves GET /v1/models and POST /v1/completions (streaming or not, greedy or temperature
sampling, `max_tokens`, `ignore_eos`, `stream_options.include_usage`), enough for
`kiln bench serve` to measure what continuous batching gains over serving requests in turn.
Each request runs prefill then a token-by-token decode loop with transformers' KV cache, in a
worker thread, under one lock.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
import uuid

import torch
import transformers
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


def build_app(model_dir: str) -> FastAPI:
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    name = model_dir.rstrip("/").split("/")[-1]
    lock = threading.Lock()
    app = FastAPI()

    def generate(ids: list[int], max_tokens: int, temperature: float, ignore_eos: bool, emit):
        """Decode token by token, calling emit(token_id) for each; under the lock: one request at a time."""
        with lock, torch.no_grad():
            past, x = None, torch.tensor([ids])
            for _ in range(max_tokens):
                out = model(input_ids=x, past_key_values=past, use_cache=True)
                past, logits = out.past_key_values, out.logits[0, -1]
                if temperature > 0:
                    tok_id = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1))
                else:
                    tok_id = int(logits.argmax())
                emit(tok_id)
                if tok_id == tok.eos_token_id and not ignore_eos:
                    break
                x = torch.tensor([[tok_id]])

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "hf-baseline"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        prompt = body["prompt"]
        ids = tok(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)
        max_tokens, temperature = int(body.get("max_tokens") or 16), float(body.get("temperature", 1.0))
        ignore_eos = bool(body.get("ignore_eos", False))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        worker = loop.run_in_executor(None, generate, ids, max_tokens, temperature, ignore_eos,
                                      lambda t: loop.call_soon_threadsafe(queue.put_nowait, t))
        worker.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, None))

        async def tokens():
            out = []
            while (t := await queue.get()) is not None:
                out.append(t)
                yield t, out

        def usage(n):
            return {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}

        if not body.get("stream"):
            out = [t async for t, _ in tokens()]
            return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": name,
                                 "choices": [{"index": 0, "text": tok.decode(out, skip_special_tokens=True),
                                              "finish_reason": "length", "logprobs": None}],
                                 "usage": usage(len(out))})

        async def events():
            text, n = "", 0
            async for _, out in tokens():
                full = tok.decode(out, skip_special_tokens=True)
                piece, text, n = full[len(text):], full, len(out)
                chunk = {"id": rid, "object": "text_completion", "created": created, "model": name,
                         "choices": [{"index": 0, "text": piece, "finish_reason": None, "logprobs": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                yield f"data: {json.dumps({'id': rid, 'object': 'text_completion', 'choices': [], 'usage': usage(n)})}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--port", type=int, default=8001)
    ap.add_argument("--threads", type=int, default=None, help="default: every core")
    args = ap.parse_args()
    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    uvicorn.run(build_app(args.model_dir), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
