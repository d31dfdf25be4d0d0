"""RequestOutputs as OpenAI JSON: whole responses, stream chunks, usage and logprobs, for
/v1/completions (`Completion`) and /v1/chat/completions (`Chat`).

One HTTP request may hold several engine requests (one per prompt); prompt k's sample i is the
response's choice k * n + i, as in OpenAI's API. Usage sums over prompts (each prompt's tokens
counted once) and over every choice's completion tokens.
"""
from __future__ import annotations

from .reasoning import ReasoningStream, split
from .tool_calls import ToolFormat, calls_ended, held_back, parse


class _Format:
    prefix = ""
    object_name = ""
    chunk_name = ""

    def __init__(self, tokenizer, body, prompt_ids: list[list[int]], prompt_texts: list[str | None],
                 request_ids: list[str]):
        self.tok, self.body, self.prompt_ids, self.prompt_texts = tokenizer, body, prompt_ids, prompt_texts
        self._prompt_of = {rid: k for k, rid in enumerate(request_ids)}
        self._sent_tokens: dict[int, int] = {}     # per choice: how many tokens' logprobs were streamed

    def choice_index(self, out, c) -> int:
        return self._prompt_of[out.request_id] * self.body.n + c.index

    def token_text(self, token: int) -> str:
        return self.tok.decode_raw([token], skip_special_tokens=False)

    def _new_logprobs(self, out, c, streaming: bool):
        if c.logprobs is None:
            return None
        index = self.choice_index(out, c)
        start = self._sent_tokens.get(index, 0) if streaming else 0
        if streaming:
            self._sent_tokens[index] = len(c.token_ids)
        return self.logprobs(out, c.token_ids[start:], c.logprobs[start:], first=start == 0,
                             stream_index=index if streaming else None)

    def usage(self, finals: list) -> dict:
        prompt = sum(len(ids) for ids in self.prompt_ids)
        completion = sum(len(c.token_ids) for out in finals for c in out.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _envelope(self, request_id, created, model, name) -> dict:
        return {"id": request_id, "object": name, "created": created, "model": model}

    def response(self, finals: list, request_id, created, model) -> dict:
        """The whole response from each prompt's final output (in prompt order)."""
        choices = [self.choice(out, c) for out in finals for c in out.outputs]
        return {**self._envelope(request_id, created, model, self.object_name), "choices": choices,
                "usage": self.usage(finals)}

    def chunks(self, out, request_id, created, model):
        """One stream chunk per choice that got tokens (or finished) in this step."""
        for c in out.outputs:
            if c.new_text or c.new_token_ids or c.finish_reason or self.choice_index(out, c) not in self._sent_tokens:
                yield {**self._envelope(request_id, created, model, self.chunk_name),
                       "choices": [self.stream_choice(out, c)]}

    def usage_chunk(self, finals: list, request_id, created, model) -> dict:
        return {**self._envelope(request_id, created, model, self.chunk_name), "choices": [],
                "usage": self.usage(finals)}


class Completion(_Format):
    prefix, object_name, chunk_name = "cmpl", "text_completion", "text_completion"

    def __init__(self, *args):
        super().__init__(*args)
        self._text_pos: dict[int | None, int] = {}     # per streamed choice: where its next token's text starts

    def _prompt_text(self, out) -> str:
        k = self._prompt_of[out.request_id]
        text = self.prompt_texts[k]
        return text if text is not None else self.tok.decode(self.prompt_ids[k])

    def logprobs(self, out, tokens, lps, first: bool, stream_index: int | None = None) -> dict:
        """OpenAI's completion logprobs; with echo, the prompt's tokens come first (the first one
        has no logprob: nothing predicts it). Text offsets run on across a choice's stream chunks."""
        entries = list(zip(tokens, (lp[t] for t, lp in zip(tokens, lps)), lps))
        if self.body.echo and first:
            prompt = self.prompt_ids[self._prompt_of[out.request_id]]
            plps = out.prompt_logprobs or [None] * len(prompt)
            entries = [(t, None if lp is None else lp[t], lp) for t, lp in zip(prompt, plps)] + entries
        texts = [self.token_text(t) for t, _, _ in entries]
        offsets, pos = [], self._text_pos.get(stream_index, 0)
        for t in texts:
            offsets.append(pos)
            pos += len(t)
        if stream_index is not None:
            self._text_pos[stream_index] = pos
        return {"tokens": texts, "token_logprobs": [value for _, value, _ in entries],
                "top_logprobs": [None if lp is None else {self.token_text(a): v for a, v in lp.items()}
                                 for _, _, lp in entries],
                "text_offset": offsets}

    def _logprobs_whole(self, out, c):
        if c.logprobs is None:
            return None
        return self.logprobs(out, c.token_ids, c.logprobs, first=True)

    def choice(self, out, c) -> dict:
        text = (self._prompt_text(out) if self.body.echo else "") + c.text
        return {"index": self.choice_index(out, c), "text": text, "logprobs": self._logprobs_whole(out, c),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def stream_choice(self, out, c) -> dict:
        index = self.choice_index(out, c)
        first = index not in self._sent_tokens
        logprobs = self._new_logprobs(out, c, True)
        self._sent_tokens.setdefault(index, 0)
        text = (self._prompt_text(out) if self.body.echo and first else "") + c.new_text
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}


class Chat(_Format):
    """Chat completions; with a reasoning parser the thinking goes to reasoning_content, with a tool
    format (tools in force) the calls the reply makes go to tool_calls."""
    prefix, object_name, chunk_name = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, *args, reasoning_parser: str | None = None, tool_format: ToolFormat | None = None):
        super().__init__(*args)
        self.reasoning_parser, self.tool_format = reasoning_parser, tool_format
        self._reasoning: dict[int, ReasoningStream] = {}      # per streamed choice
        self._answer: dict[int, list] = {}                    # per streamed choice: [its answer text, sent]

    def logprobs(self, out, tokens, lps, first: bool, stream_index: int | None = None) -> dict:
        def entry(token, value):
            text = self.token_text(token)
            return {"token": text, "logprob": value, "bytes": list(self.tok.token_bytes(token))}
        return {"content": [{**entry(t, lp[t]),
                             # lp holds the sampled token and the top k: the k best are the top k
                             "top_logprobs": [entry(a, v) for a, v in sorted(lp.items(), key=lambda kv: -kv[1])
                                              ][:self.body.top_logprobs or 0]}
                            for t, lp in zip(tokens, lps)]}

    def _message(self, text: str) -> dict:
        message = {"role": "assistant", "content": text}
        if self.reasoning_parser:
            message["reasoning_content"], message["content"] = split(self.reasoning_parser, text)
        if self.tool_format:
            content, calls = parse(self.tool_format, message["content"])
            if calls:
                message["content"], message["tool_calls"] = content, [c.as_json() for c in calls]
        return message

    def _finish(self, c, called: bool) -> str | None:
        """tool_calls for a reply that made calls: one that ended, or (under a required or named
        tool_choice, whose grammar lets it write only calls) one max_tokens cut after whole calls."""
        return "tool_calls" if called and calls_ended(self.body, c.finish_reason) else c.finish_reason

    def choice(self, out, c) -> dict:
        message = self._message(c.text)
        return {"index": self.choice_index(out, c), "message": message,
                "logprobs": self._new_logprobs(out, c, False),
                "finish_reason": self._finish(c, "tool_calls" in message), "stop_reason": c.stop_reason}

    def chunks(self, out, request_id, created, model):
        """Each choice's new text as a delta; at its end, the tool calls it made, each as a delta with
        its name and one with its arguments."""
        for c in out.outputs:
            index = self.choice_index(out, c)
            if not (c.new_text or c.new_token_ids or c.finish_reason or index not in self._sent_tokens):
                continue
            for choice in self._stream_choices(out, c, index):
                yield {**self._envelope(request_id, created, model, self.chunk_name), "choices": [choice]}

    def _stream_choices(self, out, c, index: int) -> list[dict]:
        final = c.finish_reason is not None
        reasoning, answer = "", c.new_text
        if self.reasoning_parser:
            parts = self._reasoning.setdefault(index, ReasoningStream(self.reasoning_parser))
            reasoning, answer = parts.feed(c.new_text, final)
        calls = []
        if self.tool_format:
            held = self._answer.setdefault(index, ["", 0])
            held[0] += answer
            end = len(held[0])
            if final:
                _, calls = parse(self.tool_format, held[0])
                end = held_back(self.tool_format, held[0]) if calls else end
            else:
                end = held_back(self.tool_format, held[0])
            answer, held[1] = held[0][held[1]:max(end, held[1])], max(end, held[1])
        delta = {"content": answer, **({"reasoning_content": reasoning} if reasoning else {})}
        if index not in self._sent_tokens:            # the first chunk of a choice names the role
            delta = {"role": "assistant", **delta}
        logprobs = self._new_logprobs(out, c, True)
        self._sent_tokens.setdefault(index, 0)
        choices = [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}]
        for i, call in enumerate(calls):
            opened = {"index": i, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
            choices.append({"index": index, "logprobs": None, "finish_reason": None, "delta": {"tool_calls": [opened]}})
            choices.append({"index": index, "logprobs": None, "finish_reason": None, "delta": {"tool_calls": [
                {"index": i, "function": {"arguments": call.arguments}}]}})
        choices[-1]["finish_reason"] = self._finish(c, bool(calls))
        return choices
