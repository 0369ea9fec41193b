"""OpenAI's Files and Batch APIs (serve/openai_batches.py), driven by the official `openai` client against
`jaxcb serve --http-port` on the tiny model: a batch's answers are the API's own, it gives way to a full
queue and loses nothing, a bad file fails whole with its lines named, cancelling aborts what runs, each
token's files are its own, and the store's limits hold."""

from __future__ import annotations

import io
import json
import time

import httpx
import openai
import pytest

from serve.client import Client
from tests.server_util import http_server, wait_pool_whole

ENDED = ("completed", "failed", "cancelled")


def jsonl(lines) -> io.BytesIO:
    return io.BytesIO(("\n".join(json.dumps(x) for x in lines) + "\n").encode())


def line(custom_id, body, url="/v1/completions"):
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def wait_ended(oai, batch_id, timeout=120.0):
    deadline = time.monotonic() + timeout
    while True:
        b = oai.batches.retrieve(batch_id)
        if b.status in ENDED:
            return b
        assert time.monotonic() < deadline, b
        time.sleep(0.1)


@pytest.fixture(scope="module")
def server(tiny_gguf_path, config_path):
    yield from http_server(tiny_gguf_path, config_path, "--max-waiting", "3")


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.http + "/v1", api_key="unused", max_retries=0)


def test_a_batch_answers_as_the_api_does_behind_a_full_queue(server, oai):
    """12 lines against --max-waiting 3: lines the full queue refuses wait and run again (none fails for it);
    each answer is the API's own for that body (greedy tokens as posted directly); a refused line goes to the
    error file; the files read back as written, purpose batch_output."""
    bodies = [{"prompt": [5 + i, 6, 7], "max_tokens": 5 + i, "ignore_eos": True, "temperature": 0,
               "return_token_ids": True} for i in range(12)]
    lines = [line(f"r{i}", b) for i, b in enumerate(bodies)] + [line("big", {"prompt": "hi", "max_tokens": 10**6})]
    upload = oai.files.create(file=("batch.jsonl", jsonl(lines)), purpose="batch")
    assert upload.purpose == "batch" and upload.bytes == len(jsonl(lines).getvalue())
    assert oai.files.content(upload.id).content == jsonl(lines).getvalue()
    created = oai.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h",
                                 metadata={"job": "nightly"})
    assert created.status in ("validating", "in_progress") and created.metadata == {"job": "nightly"}
    done = wait_ended(oai, created.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (13, 12, 1)
    assert done.in_progress_at >= done.created_at and done.completed_at >= done.in_progress_at
    out = [json.loads(x) for x in oai.files.content(done.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in out] == [f"r{i}" for i in range(12)]  # input order
    for o, body in zip(out, bodies):
        assert o["error"] is None and o["response"]["status_code"] == 200
        direct = oai.completions.create(model="tiny", **{k: v for k, v in body.items() if k in ("prompt", "max_tokens",
                                        "temperature")}, extra_body={"ignore_eos": True, "return_token_ids": True})
        assert o["response"]["body"]["choices"][0]["token_ids"] == direct.choices[0].token_ids
    errors = [json.loads(x) for x in oai.files.content(done.error_file_id).text.splitlines()]
    assert [e["custom_id"] for e in errors] == ["big"] and errors[0]["response"]["status_code"] == 400
    assert errors[0]["error"]["line"] == 13 and "max_tokens" in errors[0]["error"]["message"]
    assert oai.files.retrieve(done.output_file_id).purpose == "batch_output"
    assert created.id in [b.id for b in oai.batches.list().data]
    assert {upload.id, done.output_file_id, done.error_file_id} <= {f.id for f in oai.files.list().data}
    assert oai.files.delete(upload.id).deleted
    with pytest.raises(openai.NotFoundError):
        oai.files.retrieve(upload.id)
    assert _pool_whole(server).running == 0


def test_a_bad_file_fails_whole_with_its_lines_named(server, oai):
    lines = [line("a", {"prompt": "x", "max_tokens": 2}), line("a", {"prompt": "y"}),
             line("b", {"messages": []}, url="/v1/chat/completions"), {"custom_id": "c", "method": "GET",
                                                                       "url": "/v1/completions", "body": {}}]
    upload = oai.files.create(file=("bad.jsonl", jsonl(lines)), purpose="batch")
    done = wait_ended(oai, oai.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                              completion_window="24h").id)
    assert done.status == "failed" and done.output_file_id is None
    assert [(e.line, e.code) for e in done.errors.data] == [(2, "duplicate_custom_id"), (3, "mismatched_endpoint"),
                                                            (4, "invalid_request")]
    for kwargs, field in ((dict(endpoint="/v1/load_lora_adapter", completion_window="24h"), "endpoint"),
                          (dict(endpoint="/v1/completions", completion_window="1h"), "completion_window")):
        with pytest.raises(openai.BadRequestError, match=field):
            oai.batches.create(input_file_id=upload.id, **kwargs)
    with pytest.raises(openai.NotFoundError, match="input_file_id"):
        oai.batches.create(input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        oai.files.create(file=("x.jsonl", jsonl(lines)), purpose="fine-tune")
    raw = httpx.post(f"{server.http}/v1/files", content=b"not multipart", headers={"content-type": "text/plain"})
    assert raw.status_code == 400 and "multipart/form-data" in raw.json()["error"]["message"]
    raw = httpx.post(f"{server.http}/v1/files", files={"file": ("x.jsonl", b"{}")}, data={"purpose": "batch",
                                                                                         "colour": "red"})
    assert raw.status_code == 400 and raw.json()["error"]["message"].startswith("'colour': not a field")


def test_cancelling_a_batch_aborts_its_requests_and_keeps_what_ran(server, oai):
    lines = [line(f"r{i}", {"prompt": [5, 6], "max_tokens": 200, "ignore_eos": True}) for i in range(40)]
    upload = oai.files.create(file=("long.jsonl", jsonl(lines)), purpose="batch")
    b = oai.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while oai.batches.retrieve(b.id).request_counts.completed < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert oai.batches.cancel(b.id).status in ("cancelling", "cancelled")
    done = wait_ended(oai, b.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    assert 1 <= done.request_counts.completed < 40 and done.request_counts.failed == 0
    kept = oai.files.content(done.output_file_id).text.splitlines()
    assert len(kept) == done.request_counts.completed
    assert all(len(json.loads(k)["response"]["body"]["choices"][0]["text"]) > 0 for k in kept)
    assert _pool_whole(server).running == 0  # the lines in flight were aborted, their pages freed
    with pytest.raises(openai.ConflictError):
        oai.batches.cancel(b.id)


def test_each_token_keeps_its_own_files_within_its_share_of_the_limit(tiny_gguf_path, config_path):
    for s in http_server(tiny_gguf_path, config_path, "--auth-token", "alice", "--auth-token", "bob",
                         "--batch-files-mb", "0.004"):  # 4,194 bytes
        alice = openai.OpenAI(base_url=s.http + "/v1", api_key="alice", max_retries=0)
        bob = openai.OpenAI(base_url=s.http + "/v1", api_key="bob", max_retries=0)
        mine = alice.files.create(file=("a.jsonl", jsonl([line("a", {"prompt": [5], "max_tokens": 2})])),
                                  purpose="batch")
        b = alice.batches.create(input_file_id=mine.id, endpoint="/v1/completions", completion_window="24h")
        with pytest.raises(openai.NotFoundError):
            bob.files.retrieve(mine.id)
        with pytest.raises(openai.NotFoundError):
            bob.batches.retrieve(b.id)
        with pytest.raises(openai.NotFoundError):
            bob.batches.create(input_file_id=mine.id, endpoint="/v1/completions", completion_window="24h")
        assert bob.files.list().data == [] and bob.batches.list().data == []
        assert wait_ended(alice, b.id).status == "completed"
        with pytest.raises(openai.APIStatusError) as e:  # (past alice's half of the store, not past bob's)
            alice.files.create(file=("big.jsonl", io.BytesIO(b"x" * 1800)), purpose="batch")
        assert e.value.status_code == 413 and "file:" in e.value.message
        assert bob.files.create(file=("big.jsonl", io.BytesIO(b"x" * 1800)), purpose="batch").bytes == 1800
        with pytest.raises(openai.APIStatusError) as e:
            bob.files.create(file=("more.jsonl", io.BytesIO(b"x" * 1800)), purpose="batch")
        assert e.value.status_code == 413
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.http + "/v1", api_key="eve", max_retries=0).files.list()


def _pool_whole(server):
    with Client(server.target) as c:
        return wait_pool_whole(c, 10.0)


def test_list_and_delete_pages_on_and_the_counts_usage_and_lines_read_back(server, oai):
    """The SDK's list-and-delete loop pages on past ids it just deleted; a batch's usage and model are filled; an
    answer holding U+2028 stays one line for splitlines; a byte-order mark before the first line is taken; more
    samples than the queue ever holds is the line's 400 (it had been sent again for ever)."""
    made = [oai.files.create(file=(f"f{i}.jsonl", jsonl([line("a", {"prompt": [5], "max_tokens": 1})])),
                             purpose="batch").id for i in range(5)]
    gone = []
    for f in oai.files.list(limit=2):
        if f.id in made:
            oai.files.delete(f.id)
            gone.append(f.id)
    assert sorted(gone) == sorted(made)
    body = {"prompt": [5, 6], "max_tokens": 3, "ignore_eos": True, "echo": True}
    raw = ("\ufeff" + json.dumps(line("u", {**body, "prompt": "x\u2028y"})) + "\n"
           + json.dumps(line("big", {"prompt": [5], "max_tokens": 1, "n": 16})) + "\n").encode()
    upload = oai.files.create(file=("u.jsonl", io.BytesIO(raw)), purpose="batch")
    done = wait_ended(oai, oai.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                              completion_window="24h").id)
    assert done.status == "completed" and done.request_counts.completed == 1 and done.request_counts.failed == 1
    assert done.usage.output_tokens == 3 and done.usage.input_tokens > 0 and done.model
    text = oai.files.content(done.output_file_id).text
    assert len(text.splitlines()) == 1 and "\u2028" in json.loads(text)["response"]["body"]["choices"][0]["text"]
    refused = json.loads(oai.files.content(done.error_file_id).text)
    assert refused["response"]["status_code"] == 400 and refused["error"]["message"].startswith("n: 16 samples")
