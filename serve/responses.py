"""RequestOutputs as OpenAI JSON: whole responses, stream chunks, usage and logprobs, for
/v1/completions (`Completion`) and /v1/chat/completions (`Chat`)."""
from __future__ import annotations


def usage(out) -> dict:
    completion = sum(len(c.token_ids) for c in out.outputs)
    return {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": completion,
            "total_tokens": len(out.prompt_token_ids) + completion}


class _Format:
    prefix = ""
    object_name = ""
    chunk_name = ""

    def __init__(self, tokenizer, body, prompt_ids):
        self.tok, self.body, self.prompt_ids = tokenizer, body, prompt_ids
        self._sent_tokens: dict[int, int] = {}     # per choice: how many tokens' logprobs were streamed

    def token_text(self, token: int) -> str:
        return self.tok.decode_raw([token], skip_special_tokens=False)

    def _new_logprobs(self, c, streaming: bool):
        if c.logprobs is None:
            return None
        start = self._sent_tokens.get(c.index, 0) if streaming else 0
        if streaming:
            self._sent_tokens[c.index] = len(c.token_ids)
        return self.logprobs(c.token_ids[start:], c.logprobs[start:])

    def chunks(self, out, request_id, created, model):
        """One stream chunk per choice that got tokens (or finished) in this step."""
        for c in out.outputs:
            if c.new_text or c.new_token_ids or c.finish_reason:
                yield {"id": request_id, "object": self.chunk_name, "created": created, "model": model,
                       "choices": [self.stream_choice(c)]}

    def usage_chunk(self, out, request_id, created, model) -> dict:
        return {"id": request_id, "object": self.chunk_name, "created": created, "model": model, "choices": [],
                "usage": usage(out)}


class Completion(_Format):
    prefix, object_name, chunk_name = "cmpl", "text_completion", "text_completion"

    def logprobs(self, tokens, lps) -> dict:
        texts = [self.token_text(t) for t in tokens]
        offsets, pos = [], 0
        for t in texts:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": texts, "token_logprobs": [lp[t] for t, lp in zip(tokens, lps)],
                "top_logprobs": [{self.token_text(a): v for a, v in lp.items()} for lp in lps],
                "text_offset": offsets}

    def _text(self, c) -> str:
        prompt = self.tok.decode(self.prompt_ids) if self.body.echo else ""
        return prompt + c.text

    def response(self, out, request_id, created, model) -> dict:
        choices = [{"index": c.index, "text": self._text(c), "logprobs": self._new_logprobs(c, False),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in out.outputs]
        return {"id": request_id, "object": self.object_name, "created": created, "model": model,
                "choices": choices, "usage": usage(out)}

    def stream_choice(self, c) -> dict:
        return {"index": c.index, "text": c.new_text, "logprobs": self._new_logprobs(c, True),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}


class Chat(_Format):
    prefix, object_name, chunk_name = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, tokenizer, body, prompt_ids):
        super().__init__(tokenizer, body, prompt_ids)
        self._started: set[int] = set()

    def logprobs(self, tokens, lps) -> dict:
        def entry(token, value):
            text = self.token_text(token)
            return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}
        return {"content": [{**entry(t, lp[t]),
                             # lp holds the sampled token and the top k: the k best are the top k
                             "top_logprobs": [entry(a, v) for a, v in sorted(lp.items(), key=lambda kv: -kv[1])
                                              ][:self.body.top_logprobs or 0]}
                            for t, lp in zip(tokens, lps)]}

    def response(self, out, request_id, created, model) -> dict:
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._new_logprobs(c, False), "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason} for c in out.outputs]
        return {"id": request_id, "object": self.object_name, "created": created, "model": model,
                "choices": choices, "usage": usage(out)}

    def stream_choice(self, c) -> dict:
        delta = {"content": c.new_text}
        if c.index not in self._started:            # the first chunk of a choice names the role
            self._started.add(c.index)
            delta = {"role": "assistant", **delta}
        return {"index": c.index, "delta": delta, "logprobs": self._new_logprobs(c, True),
                "finish_reason": c.finish_reason}
