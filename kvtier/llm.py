"""The offline Python API, shaped like vLLM's ``LLM`` so users can switch.

from kvtier import LLM, SamplingParams
llm = LLM()                                     # embedded SmolLM2-135M-Instruct
outs = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=32))
outs[0].outputs[0].text, outs[0].outputs[0].token_ids, outs[0].num_cached_tokens
llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=32))
out = llm.chat(messages, tools=[{"type": "function", "function": {...}}], tool_choice="required")[0]
out.outputs[0].tool_calls, out.outputs[0].content
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from kvtier.chat_format import ChatTemplateArgs
from kvtier.config import ConfigError, EngineArgs
from kvtier.engine import LLMEngine
from kvtier.kv.retention import RetentionSpan
from kvtier.outputs import RequestOutput
from kvtier.prompt_input import PromptType
from kvtier.sampling_params import SamplingParams, StructuredOutputs
from kvtier.tools import (
    CLOSE,
    Tool,
    ToolChoice,
    call_grammar,
    parse_tool_calls,
    parse_tool_choice,
    parse_tools,
)
from kvtier.worker.structured import check_tool_schemas

Conversation = list[dict[str, Any]]


def _engine_args(model: str | None, kwargs: dict[str, Any]) -> EngineArgs:
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise ConfigError(f"unknown engine argument(s): {', '.join(unknown)}")
    return EngineArgs(model=model, **kwargs)


class LLM:
    def __init__(self, model: str | None = None, *, progress: bool = False, **engine_kwargs: Any):
        self.engine = LLMEngine(_engine_args(model, engine_kwargs), progress=progress)

    def close(self) -> None:
        """Flush the KV tiers (a restart on the same ``kv_disk_dir`` finds the blocks) and stop the
        disk worker. Also run by ``with LLM(...) as llm:``."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self):  # noqa: ANN201 - kvtier.tokenizer.Tokenizer
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        cache_salt: str | None = None,
        retention: Sequence[RetentionSpan] = (),
    ) -> list[RequestOutput]:
        """Run every prompt to completion (continuously batched); outputs in prompt order.
        ``retention``: keep each prompt's first tokens cached for a while (kvtier/kv/retention.py)."""
        prompt_list = self._as_prompt_list(prompts)
        params = self._as_params_list(sampling_params, len(prompt_list))
        ids: list[str] = []
        try:
            for prompt, p in zip(prompt_list, params, strict=True):  # final_only: no output per step
                rid = self.engine.add_request(
                    prompt, p, cache_salt=cache_salt, retention=retention, final_only=True
                )
                ids.append(rid)
        except Exception:
            for rid in ids:  # a bad prompt queues nothing: withdraw the ones already added
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        cache_salt: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template and generate; one output per conversation.

        ``tools`` (OpenAI's ``[{"type": "function", "function": {"name", "description", "parameters"}}]``),
        ``tool_choice`` (``"auto"``, the default with tools; ``"none"``; ``"required"``; or ``{"type":
        "function", "function": {"name": ...}}``) and ``parallel_tool_calls`` work as the server's: the tools
        are rendered (:mod:`kvtier.tools`), a forced call is held to the tools' schemas, and each completion's
        ``tool_calls`` and ``content`` hold the parsed calls and the text outside them. Messages may carry
        assistant ``tool_calls`` and ``tool`` results. ConfigError (``ToolError``) for bad tools.
        ``continue_final_message=True, add_generation_prompt=False`` continues the last message (an
        assistant prefill: the output is what follows it); ``chat_template_kwargs`` are more template
        variables, e.g. Qwen3's ``{"enable_thinking": False}`` (:mod:`kvtier.chat_format`)."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        given = parse_tools(tools)
        choice = parse_tool_choice(tool_choice, given, parallel_tool_calls)
        check_tool_schemas(given)
        template = ChatTemplateArgs(
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            template_kwargs=dict(chat_template_kwargs or {}),
        )
        prompts = [self.render_chat(c, tools=given, **template) for c in conversations]
        params = self._as_params_list(sampling_params, len(prompts))
        if given:
            params = [_with_tools(p, given, choice) for p in params]
        outputs = self.generate(prompts, params, use_tqdm=use_tqdm, cache_salt=cache_salt)
        if choice.mode != "none":
            names = {t.name for t in given}
            for completion in (c for out in outputs for c in out.outputs):
                completion.content, completion.tool_calls = parse_tool_calls(completion.text, names)
        return outputs

    def render_chat(
        self,
        conversation: Conversation,
        add_generation_prompt: bool = True,
        tools: list[Tool] | None = None,
        *,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        if not conversation:
            raise ConfigError("messages must not be empty")
        # Contents are tokenized as text (a user's "<|im_end|>" is not a control token); no BOS is
        # added (the template writes the special tokens it wants). The server does the same.
        text, token_ids = self.tokenizer.encode_chat(
            list(conversation),
            add_generation_prompt,
            tools=tools,
            continue_final_message=continue_final_message,
            template_kwargs=template_kwargs,
        )
        return {"prompt": text, "prompt_token_ids": token_ids}

    def stream(
        self, prompt: PromptType, sampling_params: SamplingParams | None = None, cache_salt: str | None = None
    ) -> Iterator[RequestOutput]:
        """Yield a ``RequestOutput`` after every step that adds to this request (text_delta)."""
        rid = self.engine.add_request(prompt, sampling_params, cache_salt=cache_salt)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort_request(rid)

    # ----------------------------------------------------------------------------------------
    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req", dynamic_ncols=True)
        try:
            while len(final) < len(ids) and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [final[rid] for rid in ids]

    @staticmethod
    def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        if isinstance(prompts, str | Mapping):
            return [prompts]
        items = list(prompts)
        if items and all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            return [items]  # one prompt given as token ids
        return items

    @staticmethod
    def _as_params_list(
        params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(params, SamplingParams):
            return [params] * n
        plist = list(params)
        if len(plist) != n:
            raise ConfigError(f"got {len(plist)} SamplingParams for {n} prompts")
        return plist


def _with_tools(params: SamplingParams, tools: list[Tool], choice: ToolChoice) -> SamplingParams:
    """``params`` for a chat with tools: a forced call's grammar, or (auto, one call at most) a stop at the
    end of the first call. A copy: the caller's params may serve other prompts."""
    if choice.constrained:
        if params.structured_outputs is not None:
            raise ConfigError(
                "structured_outputs cannot be combined with tool_choice 'required' or a named function"
            )
        return dataclasses.replace(
            params, structured_outputs=StructuredOutputs(grammar=call_grammar(tools, choice))
        )
    if choice.mode == "auto" and not choice.parallel:
        return dataclasses.replace(params, stop=[*params.stop, CLOSE])
    return params
