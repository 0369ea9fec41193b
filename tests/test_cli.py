"""`jaxcb generate` as a user runs it, in a subprocess, on the tiny GGUF model."""

import json
import re
import subprocess
import sys

import pytest

from tests.tiny_gguf import write_tiny_gguf


def run_cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "jaxcb", *args], capture_output=True, text=True, timeout=300, **kw)


@pytest.fixture(scope="module")
def small_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "small.toml"
    path.write_text(
        "[model]\ncompile = \"fast\"\n[cache]\npage_size = 16\nnum_pages = 128\n"
        "[scheduler]\nmax_context = 256\nmax_prefill_tokens = 64\n"
        "[buckets]\ndecode_batch = [1, 4]\npages_per_seq = [4, 16]\nprefill_tokens = [32, 64]\n"
    )
    return str(path)


def test_generate_file_keeps_order_and_reports_bad_lines(tiny_gguf_path, small_config, tmp_path):
    lines = [
        {"prompt": "the weather", "max_tokens": 5, "ignore_eos": True},
        {"prompt_token_ids": [5, 6, 7], "max_tokens": 3, "ignore_eos": True, "id": "abc"},
        "this line is not json",
        {"prompt_token_ids": [5, 100000], "max_tokens": 3},
        {"prompt": "hi", "max_tokens": 0},
        {"prompt": "is it", "chat": False, "max_tokens": 4, "ignore_eos": True},
        {"prompt": "a code", "max_tokens": 40, "structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}},
        {"prompt": "json", "max_tokens": 60, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                    "additionalProperties": False}}}},
        {"prompt": "bad", "max_tokens": 4, "structured_outputs": {"regex": "[a-"}},
        {"messages": [1], "max_tokens": 2},  # once crashed the whole run
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "is it"}]}], "max_tokens": 3,
         "ignore_eos": True, "logit_bias": {"7": 100}},
        {"prompt": "is it", "max_tokens": 2, "logit_bias": {"seven": 1}},
        {"prompt_token_ids": [5, 6, 7, 8], "max_tokens": 0, "prompt_logprobs": 1},
        {"prompt_token_ids": [5, 6, 7], "max_tokens": 8, "ignore_eos": True, "stop_token_ids": [7],
         "allowed_token_ids": [7]},
        {"prompt": "lone \ud800", "max_tokens": 2},  # (json.dumps escapes it: no text to tokenize)
    ]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(l if isinstance(l, str) else json.dumps(l) for l in lines) + "\n")
    out = tmp_path / "out.jsonl"
    r = run_cli("generate", "--model", tiny_gguf_path, "--config", small_config, "--input", str(inp), "--output", str(out))
    assert r.returncode == 1, r.stderr
    assert "line 3: not valid JSON" in r.stderr
    assert "line 4: prompt_token_ids: token id 100000 is outside the vocabulary [0, 284)" in r.stderr
    assert "line 5: max_tokens: must be >= 1, got 0" in r.stderr
    assert "line 9: structured_outputs.regex: not a valid regex" in r.stderr
    assert "line 10: messages: must be a list of {role, content} objects" in r.stderr
    assert "line 12: logit_bias: 'seven' is not a token id" in r.stderr
    assert "line 15: prompt: holds a lone surrogate" in r.stderr
    results = [json.loads(l) for l in out.read_text().splitlines()]
    assert len(results) == 15
    assert [r.get("line") for r in results] == [None, None, 3, 4, 5, None, None, None, 9, 10, None, 12, None, None, 15]
    scored = results[12]  # the prompt's logprobs: none for its first token, then each with its rank and top 1
    assert scored["token_ids"] == [] and scored["prompt_logprobs"][0] is None and len(scored["prompt_logprobs"]) == 4
    assert all(len(e) == 3 and e[1] >= 1 and len(e[2]) == 1 for e in scored["prompt_logprobs"][1:])
    assert results[13]["token_ids"] == [7] and results[13]["stop_reason"] == 7  # the stop token that ended it
    assert results[10]["token_ids"] == [7, 7, 7]  # content parts; a bias of 100 all but forces token 7
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", results[6]["text"]), results[6]
    assert json.loads(results[7]["text"]) in ({"ok": True}, {"ok": False})
    assert len(results[0]["token_ids"]) == 5 and results[0]["finish_reason"] == "length"
    assert results[1]["prompt_token_ids"] == [5, 6, 7] and results[1]["id"] == "abc"
    assert results[5]["finish_reason"] == "length" and len(results[5]["token_ids"]) == 4
    assert results[0]["prompt_token_ids"][0] == 1  # chat template applied by default


def test_generate_reads_lines_as_json_lines_are_written(tiny_gguf_path, small_config, tmp_path):
    """--input's lines end at newlines only (a JSON string may hold U+2028, which splitlines cut: every later line
    number was off by one), a byte-order mark is allowed, and a line that is not UTF-8 is that line's error."""
    inp = tmp_path / "odd.jsonl"
    inp.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt_token_ids": [5, 6], "max_tokens": 2}).encode() + b"\r\n"
                    + json.dumps({"prompt": "a\u2028b", "max_tokens": 2, "chat": False}, ensure_ascii=False).encode()
                    + b"\n{\"prompt\": \"caf\xe9\", \"max_tokens\": 2}\n"
                    + json.dumps({"prompt_token_ids": [7], "max_tokens": 0}).encode() + b"\n")
    out = tmp_path / "out.jsonl"
    r = run_cli("generate", "--model", tiny_gguf_path, "--config", small_config, "--input", str(inp), "--output", str(out))
    assert r.returncode == 1 and "line 3: not UTF-8" in r.stderr and "line 4: max_tokens" in r.stderr, r.stderr
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r.get("line") for r in results] == [None, None, 3, 4] and len(results[1]["token_ids"]) == 2


def test_generate_prompt_and_stats(tiny_gguf_path, small_config, tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt_token_ids": [5] * n, "max_tokens": 6, "ignore_eos": True}) + "\n"
                           for n in (3, 20, 40)))
    r = run_cli("generate", "--model", tiny_gguf_path, "--config", small_config, "--input", str(inp), "--stats")
    assert r.returncode == 0, r.stderr
    out = r.stdout.strip().splitlines()
    assert len(out) == 4
    stats = json.loads(out[-1])
    assert stats["compilations_after_warmup"] == 0
    # [5] * 40 starts with [5] * 20's first full page: with the prefix cache on, 16 tokens are not recomputed
    # (which of the two computes it depends on scheduling; the other finds it cached or waits for it).
    assert stats["prefix_cache_hits"] == 16
    assert stats["prompt_tokens_computed"] == 63 - 16
    for key in ("output_tokens_per_s", "prompt_tokens_per_s", "padding_fraction", "page_utilization", "preemptions"):
        assert key in stats
    r = run_cli("generate", "--model", tiny_gguf_path, "--config", small_config, "--raw", "--max-tokens", "3", "the")
    assert r.returncode == 0, r.stderr
    # Quantized weights and KV from the command line: the same requests, nothing compiled after warm-up.
    r = run_cli("generate", "--model", tiny_gguf_path, "--config", small_config, "--input", str(inp), "--stats",
                "--weights", "int4", "--kv-dtype", "int8")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert [len(json.loads(x)["token_ids"]) for x in lines[:3]] == [6, 6, 6]
    assert json.loads(lines[-1])["compilations_after_warmup"] == 0
    r = run_cli("generate", "--model", tiny_gguf_path, "--config", small_config, "--weights", "int3", "hi")
    assert r.returncode == 2 and "--weights" in r.stderr


def test_run_batch_answers_each_line_as_the_http_api_does(tiny_gguf_path, small_config, tmp_path):
    """`jaxcb run-batch` (vLLM's, on OpenAI's Batch API lines): each body answered by the HTTP API's own
    handlers, the engine's tokens as `jaxcb generate` gives them, refusals in the API's words, lines that are
    no request named by line, the output in input order though lines end out of order (2 in flight)."""
    def line(custom_id, url, body, method="POST"):
        return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})

    greedy = {"prompt": [5, 6, 7], "max_tokens": 6, "ignore_eos": True, "temperature": 0, "return_token_ids": True}
    lines = [
        line("long", "/v1/completions", {"prompt": [9, 10], "max_tokens": 40, "ignore_eos": True}),
        line("greedy", "/v1/completions", greedy),
        "",
        line("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "is it"}], "max_tokens": 3}),
        line("embed", "/v1/embeddings", {"input": ["the weather", "is it"]}),
        line("too-long", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}),
        line("no-model", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}),
        "{not json",
        line("greedy", "/v1/completions", greedy),
        line("get", "/v1/models", {}, method="GET"),
        line("lora", "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/tmp"}),
        line("stream", "/v1/completions", {**greedy, "stream": True}),
        json.dumps({"custom_id": "extra", "method": "POST", "url": "/v1/completions", "body": greedy, "priority": 1}),
    ]
    inp = tmp_path / "batch.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    r = run_cli("run-batch", "--model", tiny_gguf_path, "--config", small_config, "-i", str(inp), "-o", "-",
                "--max-in-flight", "2")
    assert r.returncode == 1, r.stderr
    assert "12 lines, 4 answered, 8 failed" in r.stderr, r.stderr
    out = [json.loads(x) for x in r.stdout.splitlines()]
    assert [o["custom_id"] for o in out] == ["long", "greedy", "chat", "embed", "too-long", "no-model", None,
                                             "greedy", "get", "lora", "stream", "extra"]
    assert len({o["id"] for o in out}) == 12
    ok = [o["response"]["body"] for o in out[:4]]
    assert all(o["error"] is None and o["response"]["status_code"] == 200 for o in out[:4])
    assert ok[0]["usage"]["completion_tokens"] == 40 and ok[2]["object"] == "chat.completion"
    assert [len(d["embedding"]) for d in ok[3]["data"]] == [64, 64]
    g = run_cli("generate", "--model", tiny_gguf_path, "--config", small_config, "--input", "/dev/stdin",
                input=json.dumps({"prompt_token_ids": [5, 6, 7], "max_tokens": 6, "ignore_eos": True}) + "\n")
    assert g.returncode == 0, g.stderr
    assert ok[1]["choices"][0]["token_ids"] == json.loads(g.stdout.splitlines()[0])["token_ids"]
    too_long = out[4]
    assert too_long["response"]["status_code"] == 400 and too_long["error"]["line"] == 6
    assert too_long["error"]["message"] == too_long["response"]["body"]["error"]["message"]
    assert "max_tokens" in too_long["error"]["message"] and too_long["error"]["code"] == "context_length_exceeded"
    assert out[5]["response"]["status_code"] == 404 and "gpt-9" in out[5]["error"]["message"]
    errors = [(o["response"], o["error"]["code"], o["error"]["line"]) for o in out[6:]]
    assert errors == [(None, "invalid_json", 8), (None, "duplicate_custom_id", 9), (None, "invalid_request", 10),
                      (None, "invalid_url", 11), (None, "invalid_request", 12), (None, "invalid_request", 13)]
    assert out[9]["error"]["message"].startswith("url: \"/v1/load_lora_adapter\" is not a batch call")
    assert out[10]["error"]["message"].startswith("body.stream:") and out[11]["error"]["message"].startswith("priority:")


def test_cli_errors_are_clear(tiny_gguf_path, tmp_path):
    r = run_cli("generate", "--model", str(tmp_path / "missing.gguf"), "hello")
    assert r.returncode == 2 and "model: file not found" in r.stderr
    bad = tmp_path / "qwen.gguf"
    write_tiny_gguf(str(bad), arch="phi2")
    r = run_cli("generate", "--model", str(bad), "hello")
    assert r.returncode == 2 and "supported architectures: llama" in r.stderr
    r = run_cli("generate", "--model", tiny_gguf_path, "--max-tokens", "0", "hello")
    assert r.returncode == 2 and "max_tokens: must be >= 1" in r.stderr


def test_vllms_flag_names_are_taken():
    """A `vllm serve` command line's flags for what jaxcb also does mean the same here: the parallel sizes,
    the API key, TLS files, auto tool choice (always on) and the tool-call parser."""
    from jaxcb.cli.commands import build_parser

    vllm = build_parser().parse_args([
        "serve", "--tensor-parallel-size", "2", "--data-parallel-size", "3", "--api-key", "k1", "--api-key", "k2",
        "--ssl-certfile", "c.pem", "--ssl-keyfile", "k.pem", "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes"])
    ours = build_parser().parse_args([
        "serve", "--tensor-parallel", "2", "--data-parallel", "3", "--auth-token", "k1", "--auth-token", "k2",
        "--tls-cert", "c.pem", "--tls-key", "k.pem", "--tool-call-parser", "hermes"])
    assert {**vars(vllm), "enable_auto_tool_choice": False} == vars(ours)
