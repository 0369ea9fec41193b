"""Structured output and tool calls (jaxcb.host.structured, jaxcb/host/tool_calls.py): validity, what it
costs the rows that use it and the rows that do not, and tool calls through the OpenAI API.

    python -m bench.structured [--schemas 200] [--quick] [--out bench/results/structured.json]

1. Validity: --schemas generated JSON schemas (nested objects, arrays with bounds, enums, required and
   optional fields, numbers with ranges, string patterns), 50 regexes, 50 choices and 50 grammars, each
   asked of SmolLM2 in a chat at temperature 1.0: the share of outputs that parse and validate; and the
   same requests without the constraint, for comparison (the share that happen to parse).
2. Throughput: the engine benchmark's workload (bench.engine, 32 requests), all free, then with half of
   them constrained to a JSON array that cannot end within their max_tokens (so both runs make the same
   tokens); each half's output tokens/s against the same requests in the all-free run, interleaved,
   twice. Also the host's mask time per constrained step and its rows.
3. Tool calls: `jaxcb serve` on SmolLM2, tool_choice "required" through the official `openai` client,
   streamed and not: the share that parse and validate, and the time to the first tool-call delta.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time

from bench.common import machine, write_result

PATTERNS = [r"^[A-Z]{2}[0-9]{3}$", r"^[a-z]+(-[a-z]+)*$", r"^\+?[0-9]{3}-[0-9]{4}$", r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$"]
WORDS = ["red", "green", "blue", "north", "south", "alpha", "beta", "small", "large", "yes", "no", "maybe"]


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema of 1-5 properties of varied types, some required."""
    props = {}
    for i in range(rng.randint(1, 5)):
        name = rng.choice(["name", "id", "count", "price", "tags", "active", "info", "code", "items", "size"]) + str(i)
        props[name] = random_value_schema(rng, depth)
    required = [k for k in props if rng.random() < 0.7] or [next(iter(props))]
    schema = {"type": "object", "properties": props, "required": required}
    if rng.random() < 0.5:
        schema["additionalProperties"] = False
    return schema


def random_value_schema(rng: random.Random, depth: int) -> dict:
    kind = rng.choice(["string", "string", "integer", "number", "boolean", "enum", "array", "object"])
    if kind == "object" and depth >= 2:
        kind = "integer"
    if kind == "string":
        s = {"type": "string"}
        r = rng.random()
        if r < 0.3:
            s["pattern"] = rng.choice(PATTERNS)
        elif r < 0.8:
            s["maxLength"] = rng.randint(3, 24)
            if rng.random() < 0.5:
                s["minLength"] = rng.randint(1, s["maxLength"])
        return s
    if kind in ("integer", "number"):
        lo = rng.randint(-100, 100)
        s = {"type": kind, "minimum": lo}
        if rng.random() < 0.7:
            s["maximum"] = lo + rng.randint(0, 1000)
        return s
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(2, 5))}
    if kind == "array":
        lo = rng.randint(0, 2)
        return {"type": "array", "items": random_value_schema(rng, depth + 1), "minItems": lo,
                "maxItems": lo + rng.randint(1, 4)}
    return random_schema(rng, depth + 1)


def random_regex(rng: random.Random) -> str:
    return rng.choice([
        r"\d{4}-\d{2}-\d{2}", r"[A-Z][a-z]{2,8} [A-Z][a-z]{2,8}", r"\(\d{3}\) \d{3}-\d{4}", r"(yes|no|maybe)",
        r"[a-z]{3,10}@[a-z]{3,8}\.(com|org|net)", r"#[0-9a-f]{6}", r"\d{1,3}(\.\d{1,3}){3}", r"v\d+\.\d+\.\d+",
        r"[A-Z]{3}-\d{4}", r"(Mon|Tue|Wed|Thu|Fri) \d{1,2}:\d{2}"])


def random_grammar(rng: random.Random) -> tuple[str, str]:
    """(Lark grammar, a Python regex for its language) pairs."""
    return rng.choice([
        ('start: expr\nexpr: NUM (OP NUM)*\nOP: " + " | " - " | " * "\nNUM: /[0-9]{1,4}/',
         r"[0-9]{1,4}(( \+ | - | \* )[0-9]{1,4})*"),
        ('start: "[" item ("," item)* "]"\nitem: /[a-z]{1,6}/', r"\[[a-z]{1,6}(,[a-z]{1,6})*\]"),
        ('start: "SELECT " COL ("," COL)* " FROM " TAB\nCOL: /[a-z]{1,8}/\nTAB: /[a-z]{1,8}/',
         r"SELECT [a-z]{1,8}(,[a-z]{1,8})* FROM [a-z]{1,8}"),
        ('start: WORD (" " WORD){2,5} "."\nWORD: /[A-Za-z]{1,10}/', r"[A-Za-z]{1,10}( [A-Za-z]{1,10}){2,5}\."),
    ])


def validity(llm, n_schemas: int, seed: int = 0, max_tokens: int = 256, modes=(True, False)) -> dict:
    import jsonschema

    from jaxcb.host.request import SamplingParams
    from jaxcb.host.structured import Constraint

    rng = random.Random(seed)
    cases = []  # (kind, constraint, prompt, check)
    for _ in range(n_schemas):
        schema = random_schema(rng)

        def check(text, schema=schema):
            try:
                jsonschema.validate(json.loads(text), schema)
                return True
            except (ValueError, jsonschema.ValidationError):
                return False

        cases.append(("json", Constraint.json_schema(schema), f"Return only a JSON object matching this schema: "
                      f"{json.dumps(schema)}", check))
    for _ in range(50):
        rx = random_regex(rng)
        ascii_rx = rx.replace(r"\d", "[0-9]")
        cases.append(("regex", Constraint("regex", rx), f"Answer with text matching the regex {rx}",
                      lambda t, r=ascii_rx: re.fullmatch(r, t) is not None))
    for _ in range(50):
        options = rng.sample(WORDS, rng.randint(2, 5))
        cases.append(("choice", Constraint.choice(options), f"Pick one of: {', '.join(options)}",
                      lambda t, o=options: t in o))
    for _ in range(50):
        grammar, lang = random_grammar(rng)
        cases.append(("grammar", Constraint("grammar", grammar), f"Write text in this grammar:\n{grammar}",
                      lambda t, r=lang: re.fullmatch(r, t) is not None))
    out = {}
    for constrained in modes:
        convs = [[{"role": "user", "content": prompt}] for _, _, prompt, _ in cases]
        params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, structured=c if constrained else None)
                  for i, (_, c, _, _) in enumerate(cases)]
        t0 = time.perf_counter()
        results = llm.chat(convs, params)
        wall = time.perf_counter() - t0
        by_kind: dict[str, list] = {}
        for (kind, _, _, check), r in zip(cases, results):
            text = r.text if constrained else r.text.strip()
            if not constrained and kind == "json":  # a fenced block, as chat models write it
                m = re.search(r"```(?:json)?\s*(.*?)```", text, re.S)
                text = m.group(1).strip() if m else text
            by_kind.setdefault(kind, []).append((check(text), r.finish_reason))
        label = "constrained" if constrained else "unconstrained"
        out[label] = {kind: {"requests": len(v), "valid_share": round(sum(ok for ok, _ in v) / len(v), 4),
                             "length_cut": sum(f == "length" for _, f in v),
                             "valid_share_of_finished": round(sum(ok for ok, f in v if f != "length")
                                                              / max(1, sum(f != "length" for _, f in v)), 4)}
                      for kind, v in by_kind.items()}
        out[label]["max_tokens"] = max_tokens
        out[label]["wall_s"] = round(wall, 1)
        print(label, json.dumps(out[label]), flush=True)
    return out


LONG_ARRAY = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2000}


def throughput(llm, repeats: int = 2) -> dict:
    from bench.engine import workload
    from jaxcb.host.request import SamplingParams
    from jaxcb.host.structured import Constraint

    engine = llm.engine
    prompts, lens = workload(32, 0, engine.model_config.vocab_size)
    constraint = Constraint.json_schema(LONG_ARRAY)
    engine.grammars.compile(constraint)

    def run(mixed: bool):
        engine.reset_counters()
        t0 = time.perf_counter()
        finished: dict[str, float] = {}
        ids = []
        for i, (p, n) in enumerate(zip(prompts, lens)):
            structured = constraint if mixed and i % 2 == 0 else None
            ids.append(engine.add_request(p, SamplingParams(max_tokens=int(n), ignore_eos=True, structured=structured)))
        tokens: dict[str, int] = {}
        while engine.has_work():
            for ev in engine.step():
                tokens[ev.request_id] = tokens.get(ev.request_id, 0) + len(ev.token_ids)
                if ev.finished:
                    finished[ev.request_id] = time.perf_counter() - t0
        halves = {}
        for name, part in (("constrained_half", ids[0::2]), ("free_half", ids[1::2])):
            halves[name] = sum(tokens[r] for r in part) / max(finished[r] for r in part)
        st = engine.stats()
        halves.update(wall_s=round(time.perf_counter() - t0, 2), structured_steps=st.structured_steps,
                      structured_rows_per_step=round(st.structured_rows_per_step, 1),
                      mask_ms_per_step=round(st.mask_ms_per_step, 2), mask_wait_fraction=round(st.mask_wait_fraction, 3),
                      mask_wait_ms=round(st.mask_wait_ms, 2), steps=engine._counters.steps)
        assert sum(tokens.values()) == sum(lens), "a request did not make its max_tokens"
        return halves

    run(False)  # warm
    result = {"mask_ms_at_32_rows": mask_time(engine, constraint)}
    print(json.dumps(result), flush=True)
    rows = []
    for _ in range(repeats):
        free, mixed = run(False), run(True)
        rows.append({"all_free": free, "half_constrained": mixed,
                     "constrained_half_ratio": round(mixed["constrained_half"] / free["constrained_half"], 3),
                     "free_half_ratio": round(mixed["free_half"] / free["free_half"], 3)})
        print(json.dumps(rows[-1]), flush=True)
    result["runs"] = rows
    return result


def mask_time(engine, constraint, rows: int = 32, steps: int = 60) -> dict:
    """The host's time for one step's masks at `rows` constrained rows, each advancing by a random
    allowed token (the JSON array schema and a nested-object schema)."""
    import numpy as np

    from jaxcb.host.structured import Constraint

    out = {}
    nested = Constraint.json_schema(random_schema(random.Random(5)))
    for name, c in (("long_array", constraint), ("nested_object", nested)):
        g = engine.grammars
        matchers = [g.matcher(c) for _ in range(rows)]
        allowed = np.full((rows, g.words), -1, np.int32)
        rng = np.random.default_rng(0)
        times = []
        for _ in range(steps):
            live = [i for i, m in enumerate(matchers) if not m.is_stopped()]
            if not live:
                break
            t0 = time.perf_counter()
            g.fill_masks([matchers[i] for i in live], live, allowed)
            times.append(time.perf_counter() - t0)
            for i in live:
                bits = np.unpackbits(allowed[i].view(np.uint8), bitorder="little")[:g.vocab_size]
                matchers[i].consume_token(int(rng.choice(np.nonzero(bits)[0])))
        out[name] = {"mean_ms": round(1000 * float(np.mean(times)), 2), "p99_ms": round(1000 * float(np.quantile(times, 0.99)), 2),
                     "steps": len(times)}
    return out


def tool_calls(n: int, max_tokens: int = 400) -> dict:
    import jsonschema
    import openai

    from tests.server_util import ServerProcess, free_port

    tools = [
        {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                          "parameters": {"type": "object", "properties": {
                                              "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                                              "required": ["city", "unit"]}}},
        {"type": "function", "function": {"name": "search_flights", "description": "Find flights",
                                          "parameters": {"type": "object", "properties": {
                                              "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                              "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                              "passengers": {"type": "integer", "minimum": 1, "maximum": 9}},
                                              "required": ["from", "to", "passengers"]}}},
    ]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    questions = ["What's the weather in Paris?", "Find me a flight from Berlin to Rome for two.",
                 "Is it raining in Tokyo right now?", "Book 3 seats from JFK to LAX."]
    http = free_port()
    import os
    import tempfile

    cfg = os.path.join(tempfile.mkdtemp(), "tools.toml")
    with open(cfg, "w") as f:
        f.write("[scheduler]\nmax_context = 2048\n[buckets]\ndecode_batch = [1, 8]\nprefill_tokens = [256]\n")
    server = ServerProcess("smollm2-135m", cfg, "--http-port", str(http))
    try:
        server.wait_serving()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        valid = {"plain": 0, "streamed": 0}
        finishes = []
        first_delta = []
        for i in range(n):
            messages = [{"role": "user", "content": questions[i % len(questions)]}]
            kw = dict(model=model, messages=messages, tools=tools, tool_choice="required", max_tokens=max_tokens,
                      temperature=1.0, seed=i, parallel_tool_calls=False)
            r = client.chat.completions.create(**kw)
            calls = r.choices[0].message.tool_calls or []
            finishes.append(r.choices[0].finish_reason)
            valid["plain"] += bool(calls) and r.choices[0].finish_reason == "tool_calls" and all(
                _validates(jsonschema, json.loads(c.function.arguments), schemas[c.function.name]) for c in calls)
            t0 = time.perf_counter()
            got, first = {}, None
            for chunk in client.chat.completions.create(stream=True, **kw):
                for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                    first = first or time.perf_counter() - t0
                    c = got.setdefault(d.index, {"name": None, "arguments": ""})
                    c["name"] = d.function.name or c["name"]
                    c["arguments"] += d.function.arguments or ""
            first_delta.append(first)
            valid["streamed"] += bool(got) and all(
                c["name"] in schemas and _validates(jsonschema, _loads(c["arguments"]), schemas[c["name"]])
                for c in got.values())
    finally:
        server.stop()
    first_delta = sorted(x for x in first_delta if x is not None)
    return {"requests_each": n, "max_tokens": max_tokens, "finish_reasons": {f: finishes.count(f) for f in set(finishes)},
            "valid_share_plain": valid["plain"] / n, "valid_share_streamed": valid["streamed"] / n,
            "first_tool_call_delta_s_p50": round(first_delta[len(first_delta) // 2], 3) if first_delta else None,
            "first_tool_call_delta_s_max": round(first_delta[-1], 3) if first_delta else None}


def _loads(text):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _validates(jsonschema, value, schema) -> bool:
    try:
        jsonschema.validate(value, schema)
        return True
    except jsonschema.ValidationError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemas", type=int, default=200)
    ap.add_argument("--tool-requests", type=int, default=20)
    ap.add_argument("--parts", nargs="+", default=["validity", "throughput", "tools"])
    ap.add_argument("--max-tokens", type=int, default=256, help="validity: each request's max_tokens")
    ap.add_argument("--constrained-only", action="store_true", help="validity: skip the unconstrained comparison")
    ap.add_argument("--out", default="bench/results/structured.json")
    args = ap.parse_args()
    from jaxcb.llm import LLM

    result = {"machine": machine(), "model": "SmolLM2-135M-Instruct (float32)"}
    if "validity" in args.parts or "throughput" in args.parts:
        llm = LLM()
        llm.warmup()
        if "validity" in args.parts:
            result["validity"] = validity(llm, args.schemas, max_tokens=args.max_tokens,
                                          modes=(True,) if args.constrained_only else (True, False))
        if "throughput" in args.parts:
            result["throughput"] = throughput(llm)
        llm.close()
    if "tools" in args.parts:
        result["tool_calls"] = tool_calls(args.tool_requests)
        print(json.dumps(result["tool_calls"]), flush=True)
    write_result(result, args.out)


if __name__ == "__main__":
    main()
