"""`jaxcb generate`: one prompt, or a JSONL file of requests (one JSON object a line) run as one batch,
their results written in input order, and with --stats one final JSON line of figures.
"""

from __future__ import annotations

import json
import sys
import time

from jaxcb.cli.args import dtype as _dtype
from jaxcb.cli.args import engine_config as _engine_config
from jaxcb.host.errors import InvalidRequest

GENERATION_FIELDS = ("max_tokens", "min_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty", "seed", "stop", "include_stop_str_in_output",
                     "skip_special_tokens",
                     "stop_token_ids", "allowed_token_ids", "ignore_eos", "logprobs", "prompt_logprobs", "n",
                     "speculative", "bad_words")
LINE_FIELDS = {"prompt", "prompt_token_ids", "messages", "chat", "priority", "id", "response_format",
               "structured_outputs", "logit_bias", "chat_template_kwargs", "lora", *GENERATION_FIELDS}


def _adapter(args) -> str:
    """The LoRA adapter the prompt and lines without their own `lora` run with: --adapter, else the one --lora
    given alone; "" (the base model) otherwise."""
    from jaxcb.model.lora import parse_spec

    if getattr(args, "adapter", None) is not None:
        return args.adapter
    given = getattr(args, "lora", None) or []
    return parse_spec(given[0])[0] if len(given) == 1 else ""


def _make_llm(args):
    from jaxcb.device import compile_cache
    from jaxcb.llm import LLM

    compile_cache.enable(args.compile_cache)
    llm = LLM(args.model, config=_engine_config(args), dtype=_dtype(args))
    if args.record_lengths:
        llm.engine.record_lengths(args.record_lengths)
    return llm


def _params_from_args(args, overrides: dict | None = None):
    from jaxcb.host.request import SamplingParams

    values = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                  min_p=args.min_p, seed=args.seed, ignore_eos=args.ignore_eos, stop=tuple(args.stop),
                  lora=_adapter(args))
    values.update(overrides or {})
    if isinstance(values.get("stop"), str):
        values["stop"] = (values["stop"],)
    return SamplingParams(**values)


def _parse_line(llm, args, lineno: int, line: str):
    """One input line -> (prompt ids, SamplingParams, priority, id); InvalidRequest names line and field."""
    from jaxcb.host import structured
    from jaxcb.host.request import logit_bias_from_json, read_json
    from jaxcb.host.tool_calls import choose_format, render_messages
    where = f"line {lineno}"
    try:  # (as an HTTP body is read: no NaN, text only)
        obj = read_json(line, where)
    except InvalidRequest as e:  # (a field's own error is named after the line)
        raise InvalidRequest(str(e) if str(e).startswith(where + ":") else f"{where}: {e}") from None
    if not isinstance(obj, dict):
        raise InvalidRequest(f"line {lineno}: must be a JSON object")
    unknown = set(obj) - LINE_FIELDS
    if unknown:
        raise InvalidRequest(f"line {lineno}: unknown field(s) {', '.join(sorted(unknown))}")
    try:
        chat = obj.get("chat", not args.raw)
        if "prompt_token_ids" in obj:
            ids = obj["prompt_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise InvalidRequest("prompt_token_ids: must be a list of integers")
        elif "messages" in obj:
            if llm.tokenizer is None:
                raise InvalidRequest("messages: this model has no tokenizer")
            messages = obj["messages"]
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise InvalidRequest("messages: must be a list of {role, content} objects")
            # as the HTTP API takes them: content parts, an assistant's tool calls, tool results
            fmt, native = choose_format(llm.tokenizer.chat_template)
            ids = llm.tokenizer.encode_chat(render_messages(messages, None, fmt, native), True,
                                            obj.get("chat_template_kwargs"))
        elif "prompt" in obj:
            if not isinstance(obj["prompt"], str):
                raise InvalidRequest("prompt: must be a string")
            ids = llm.encode(obj["prompt"], chat=bool(chat))
        else:
            raise InvalidRequest("one of prompt, prompt_token_ids or messages is required")
        overrides = {k: obj[k] for k in (*GENERATION_FIELDS, "lora") if k in obj}
        overrides["logit_bias"] = logit_bias_from_json(obj.get("logit_bias"))
        if "response_format" in obj and "structured_outputs" in obj:
            raise InvalidRequest("structured_outputs: give either response_format or structured_outputs, not both")
        overrides["structured"] = (structured.from_response_format(obj.get("response_format"))
                                   or structured.from_structured_outputs(obj.get("structured_outputs")))
        params = _params_from_args(args, overrides)
        llm.engine.validate(ids, params)
        priority = obj.get("priority", 0)
        if not isinstance(priority, int):
            raise InvalidRequest("priority: must be an integer")
    except (ValueError, TypeError) as e:
        raise InvalidRequest(f"line {lineno}: {e}") from None
    return ids, params, priority, obj.get("id")


def _sample(out) -> dict:
    d = {"token_ids": out.token_ids, "text": out.text, "finish_reason": out.finish_reason,
         "cached_prompt_tokens": out.num_cached_tokens}
    if out.logprobs is not None:
        d["logprobs"] = out.logprobs
    if out.stop_reason is not None:
        d["stop_reason"] = out.stop_reason
    return d


def _result(outs, rid=None) -> dict:
    """One output line: the sample's fields, or with n > 1 a list of `samples`."""
    d = {"prompt_token_ids": outs[0].prompt_token_ids}
    if outs[0].prompt_logprobs is not None:  # the same for every sample
        d["prompt_logprobs"] = outs[0].prompt_logprobs
    if len(outs) == 1:
        d.update(_sample(outs[0]))
    else:
        d["samples"] = [dict(index=o.index, **_sample(o)) for o in outs]
    if rid is not None:
        d["id"] = rid
    return d


def cmd_generate(args) -> int:
    if (args.prompt is None) == (args.input is None):
        print("jaxcb generate: give either a prompt or --input FILE", file=sys.stderr)
        return 2
    llm = _make_llm(args)
    if args.stats:
        t0 = time.perf_counter()
        llm.warmup()
        print(f"warm-up: {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    if args.prompt is not None:
        outs = llm.generate([args.prompt], _params_from_args(args), chat=not args.raw)
        print(outs[0].text)
        return 0

    try:  # (lines end at newlines only: a JSON string may hold U+2028; each line decoded apart, a BOM allowed)
        with open(args.input, "rb") as f:
            lines = f.read().split(b"\n")
    except OSError as e:
        print(f"jaxcb generate: --input: {e}", file=sys.stderr)
        return 2
    slots: list[dict | None] = []
    jobs = []  # (slot index, ids, params, priority, id)
    failed = 0
    for lineno, raw in enumerate(lines, start=1):
        try:
            line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
        except UnicodeDecodeError as e:
            line = None
            error = InvalidRequest(f"line {lineno}: not UTF-8 ({e.reason} at byte {e.start})")
        if line is not None and not line.strip():
            continue
        try:
            if line is None:
                raise error
            ids, params, priority, rid = _parse_line(llm, args, lineno, line)
        except InvalidRequest as e:
            print(f"jaxcb generate: {args.input}: {e}", file=sys.stderr)
            slots.append({"line": lineno, "error": str(e)})
            failed += 1
            continue
        jobs.append((len(slots), ids, params, priority, rid))
        slots.append(None)

    engine = llm.replicas or llm.engine  # stats summed over data-parallel replicas
    compiled_before = engine.stats().compilations
    engine.reset_counters()
    t0 = time.perf_counter()
    outs = llm._run([j[1] for j in jobs], [j[2] for j in jobs], [j[3] for j in jobs]) if jobs else []
    wall = time.perf_counter() - t0
    at = 0
    for job in jobs:
        slots[job[0]] = _result(outs[at:at + job[2].n], job[4])
        at += job[2].n

    sink = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    try:
        for s in slots:
            sink.write(json.dumps(s, ensure_ascii=False) + "\n")
    finally:
        if args.output:
            sink.close()
    if args.stats:
        st = engine.stats()
        useful = sum(len(o.token_ids) for o in outs)
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
        print(json.dumps({
            "requests": len(outs), "failed_lines": failed, "wall_s": round(wall, 3),
            "output_tokens_per_s": useful / wall if wall else 0.0,
            "prompt_tokens_per_s": prompt_tokens / wall if wall else 0.0,
            "prompt_tokens_computed": st.prompt_tokens_computed,
            "compilations_after_warmup": st.compilations - compiled_before,
            "padding_fraction": st.padding_fraction, "page_utilization": st.page_utilization,
            "preemptions": st.preemptions, "host_wait_fraction": st.host_wait_fraction, "steps": st.steps,
            "prefix_cache_queries": st.prefix_cache_queries, "prefix_cache_hits": st.prefix_cache_hits,
            **({"speculative_method": st.speculative_method, "speculative_steps": st.speculative_steps,
                "speculative_proposed": st.speculative_proposed, "speculative_accepted": st.speculative_accepted,
                "acceptance_rate": st.acceptance_rate, "mean_accepted_length": st.mean_accepted_length}
               if st.speculative_method else {}),
        }))
    if failed:
        print(f"jaxcb generate: {failed} of {failed + len(jobs)} lines failed", file=sys.stderr)
        return 1
    return 0
