"""OpenAI's Files and Batch APIs (serve/openai_batches.py), driven by the official `openai` client against
`jaxcb serve --http-port` on the tiny model: a batch's answers are the API's own, it gives way to a full
queue and loses nothing, a bad file fails whole with its lines named, cancelling aborts what runs, each
token's files are its own, and the store's limits hold."""

from __future__ import annotations

import asyncio
import io
import json
import os
import time
import uuid

import httpx
import openai
import pytest

from jaxcb.host.errors import InvalidConfig
from serve import openai_batches
from serve.client import Client
from serve.openai_fields import HTTPError
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


def started_with_one_answered(oai, name, lines):
    """A batch of `lines` (/v1/completions) uploaded as `name` and made, once its first line is answered: (file,
    batch)."""
    upload = oai.files.create(file=(name, jsonl(lines)), purpose="batch")
    b = oai.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while oai.batches.retrieve(b.id).request_counts.completed < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return upload, b


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
    _, b = started_with_one_answered(oai, "long.jsonl", lines)
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
                         "--batch-files-mb", "0.004", "--dev-routes"):  # 4,194 bytes
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
        # the operator's routes are the first token's: another tenant must not slow every other
        reset = [httpx.post(s.http + "/reset_prefix_cache", headers={"Authorization": f"Bearer {t}"}, timeout=30)
                 for t in ("bob", "alice")]
        assert [r.status_code for r in reset] == [403, 200] and reset[1].json() == {"success": True}


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


# ---- the store itself (serve.openai_batches.Batches) over a stub app: which lines run, when, and what a
# --batch-dir keeps across a stop ----

class _Stub:
    """An ASGI app that answers every line 200 with its body echoed, holding each line whose body has "hold"
    while `gate` is clear; `seen` records (authorization, body) in the order lines came."""

    def __init__(self):
        self.gate, self.seen = asyncio.Event(), []

    async def __call__(self, scope, receive, send):
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        body = json.loads(raw)
        self.seen.append((dict(scope["headers"]).get(b"authorization", b"").decode(), body))
        if body.get("hold"):
            await self.gate.wait()
        answer = json.dumps({"model": "stub", "usage": {"prompt_tokens": 1, "completion_tokens": 2}, "echo": body})
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": answer.encode()})


def _store(folder=None, tokens=()):
    store = openai_batches.Batches(1 << 30, 5.0, tokens, folder)
    store.app = _Stub()
    return store


def _put(store, owner, lines, tmp_path) -> str:
    """An input file of `lines` kept as `owner`'s (what an upload ends with)."""
    path = store._new_path(f"file-{uuid.uuid4().hex}") if store.folder else tmp_path / f"file-{uuid.uuid4().hex}"
    data = jsonl(lines).getvalue()
    path.write_bytes(data)
    store._charge(owner, len(data))
    return store._keep(owner, path, len(data), "in.jsonl", "batch")["id"]


async def _until(check, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


def _make(store, owner, file_id):
    return store.create(owner, {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"})


def test_a_batch_made_during_the_warm_up_runs_once_the_server_serves(tmp_path):
    async def scenario():
        store = _store()
        b = _make(store, "", _put(store, "", [line(f"r{i}", {"prompt": "x"}) for i in range(3)], tmp_path))
        await _until(lambda: store.get("", b["id"])["status"] == "in_progress")
        await asyncio.sleep(0.2)
        assert store.app.seen == []  # (its lines would have been refused: 503, warming up)
        store.serving()
        await _until(lambda: store.get("", b["id"])["status"] == "completed")
        assert store.get("", b["id"])["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
        await store.close()

    asyncio.run(scenario())


def test_each_owners_batches_run_in_turn_and_different_owners_side_by_side(tmp_path):
    async def scenario():
        store = _store(tokens=("alice", "bob"))
        store.serving()
        held = _make(store, "token0", _put(store, "token0", [line("a", {"prompt": "x", "hold": True})], tmp_path))
        after = _make(store, "token0", _put(store, "token0", [line("a2", {"prompt": "x"})], tmp_path))
        other = _make(store, "token1", _put(store, "token1", [line("b", {"prompt": "x"})], tmp_path))
        await _until(lambda: store.get("token1", other["id"])["status"] == "completed")
        assert store.get("token0", held["id"])["status"] == "in_progress"
        assert sorted(who for who, _ in store.app.seen) == ["Bearer alice", "Bearer bob"]  # (alice's second waits)
        store.app.gate.set()
        await _until(lambda: store.get("token0", after["id"])["status"] == "completed")
        assert store.get("token0", held["id"])["status"] == "completed"
        await store.close()

    asyncio.run(scenario())


def test_a_batch_reads_its_input_to_the_end_though_the_file_is_deleted(tmp_path):
    async def scenario():
        store = _store(tmp_path)
        store.serving()
        source = _put(store, "", [line(f"r{i}", {"prompt": "x", "hold": i == 1}) for i in range(4)], tmp_path)
        b = _make(store, "", source)
        await _until(lambda: len(store.app.seen) >= 2)
        store.delete_file("", source)
        assert store.list_files("", {})["data"] == []
        store.app.gate.set()
        await _until(lambda: store.get("", b["id"])["status"] == "completed")
        assert store.get("", b["id"])["request_counts"]["completed"] == 4
        kept = [p.name for p in tmp_path.iterdir() if not p.name.endswith(".json") and p.name != ".lock"]
        assert kept == [store.get("", b["id"])["output_file_id"]]  # (the input's bytes went once it ended)
        assert store.used == store.owned[""] == (tmp_path / kept[0]).stat().st_size
        await store.close()

    asyncio.run(scenario())


def test_a_batch_dir_outlives_the_server_and_a_batch_goes_on_where_it_stopped(tmp_path):
    async def first():
        store = _store(tmp_path, ("alice", "bob"))
        store.serving()
        lines = [line(f"r{i}", {"prompt": "x", "hold": i >= 3}) for i in range(6)]
        b = _make(store, "token0", _put(store, "token0", lines, tmp_path))
        waiting = _make(store, "token0", _put(store, "token0", [line("w", {"prompt": "y"})], tmp_path))
        await _until(lambda: store.get("token0", b["id"])["request_counts"]["completed"] == 3)
        await store.close()  # (the server stops: nothing cancelled)
        return b["id"], waiting["id"]

    batch_id, waiting_id = asyncio.run(first())
    records = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert {r["info"]["status"] for r in records if r["kind"] == "batch"} == {"in_progress"}
    assert not any("alice" in p.read_text(errors="replace") for p in tmp_path.iterdir())  # (the token's hash only)
    record = json.loads((tmp_path / f"{batch_id}.json").read_text())
    with open(tmp_path / record["writing"]["output"], "ab") as f:  # a last line torn by a crash
        f.write(b'{"id": "batch_req_torn", "custom_id": "r3", "resp')

    async def second():
        store = _store(tmp_path, ("bob", "alice"))  # (alice is now the second token: owners are their tokens)
        with pytest.raises(HTTPError):
            store.get("token0", batch_id)
        taken = store.get("token1", batch_id)
        assert taken["status"] == "in_progress" and taken["request_counts"]["completed"] == 3
        store.serving()
        store.app.gate.set()
        await _until(lambda: store.get("token1", waiting_id)["status"] == "completed")
        done = store.get("token1", batch_id)
        assert done["status"] == "completed" and done["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
        assert done["usage"]["output_tokens"] == 12
        out = [json.loads(x) for x in (tmp_path / done["output_file_id"]).read_text().splitlines()]
        assert sorted(o["custom_id"] for o in out) == [f"r{i}" for i in range(6)]
        assert [body["prompt"] for _, body in store.app.seen] == ["x"] * 3 + ["y"]  # (r0-r2 not run again)
        assert {who for who, _ in store.app.seen} == {"Bearer alice"}
        on_disk = sum(p.stat().st_size for p in tmp_path.iterdir() if not p.name.endswith(".json"))
        assert store.used == store.owned["token1"] == on_disk
        await store.close()

    asyncio.run(second())


def test_a_batch_that_ends_early_lets_no_later_one_pass_an_earlier_one_still_running(tmp_path):
    """An owner's batches run one at a time whatever ends between them: a bad file (failed at validation) or
    a batch cancelled while it waits does not let the next one start beside the one running."""
    async def scenario():
        store = _store()
        store.serving()
        held = _make(store, "", _put(store, "", [line("a", {"prompt": "x", "hold": True})], tmp_path))
        bad = _make(store, "", _put(store, "", [{"custom_id": "b"}], tmp_path))
        waiting = _make(store, "", _put(store, "", [line("w", {"prompt": "w"})], tmp_path))
        after = _make(store, "", _put(store, "", [line("c", {"prompt": "c"})], tmp_path))
        await _until(lambda: store.get("", bad["id"])["status"] == "failed")
        store.cancel("", waiting["id"])
        await _until(lambda: store.get("", waiting["id"])["status"] == "cancelled")
        await asyncio.sleep(0.2)
        assert [body["prompt"] for _, body in store.app.seen] == ["x"]  # (c waits for the held one)
        store.app.gate.set()
        await _until(lambda: store.get("", after["id"])["status"] == "completed")
        assert [body["prompt"] for _, body in store.app.seen] == ["x", "c"]
        assert store.get("", held["id"])["status"] == "completed"
        await store.close()

    asyncio.run(scenario())


def test_batch_dir_records_that_name_anything_else_are_left_alone(tmp_path):
    """A record whose names are not this store's (a path outside the folder, another batch's id), whose shape is
    not, or that names a link, is not taken back: nothing it names is read, cut or removed; a pipe named like a
    record is never opened; and the server starts."""
    outside = tmp_path.parent / f"{tmp_path.name}-victim.txt"
    outside.write_text("keep me\n")
    batch_id = f"batch_{uuid.uuid4().hex}"
    good = {"kind": "batch", "owner": "", "place": 0, "source": f"file-{uuid.uuid4().hex}", "writing": {},
            "info": {"id": batch_id, "status": "in_progress", "endpoint": "/v1/completions", "created_at": 1,
                     "expires_at": int(time.time()) + 3600, "output_file_id": None, "error_file_id": None,
                     "request_counts": {"total": 1, "completed": 0, "failed": 0}}}
    linked = f"file-{uuid.uuid4().hex}"
    (tmp_path / linked).symlink_to(outside)  # (a well-formed record whose bytes are a link out of the folder)
    for name, record in ((batch_id, {**good, "writing": {"output": str(outside)}}),
                         (f"batch_{uuid.uuid4().hex}", {**good, "source": "../x"}),
                         (f"batch_{uuid.uuid4().hex}", good),  # (its id is another record's)
                         (f"batch_{uuid.uuid4().hex}", {**good, "info": {"id": "x"}}),
                         (f"batch_{uuid.uuid4().hex}", {**good, "writing": {"output": linked}}),
                         (linked, {"kind": "file", "owner": "", "place": 1, "info": {
                             "id": linked, "filename": "x", "purpose": "batch", "created_at": 1}})):
        (tmp_path / f"{name}.json").write_text(json.dumps(record))
    os.mkfifo(tmp_path / "zz.json")  # (a pipe among the records: never opened)

    async def scenario():
        store = _store(tmp_path)
        assert store.jobs == {} and store.used == 0
        store.serving()
        await store.close()

    asyncio.run(scenario())
    assert outside.read_text() == "keep me\n" and len(list(tmp_path.glob("*.json"))) == 7


def test_batches_taken_back_that_read_one_deleted_input_charge_it_once(tmp_path):
    """Two batches reading one input deleted meanwhile, taken back after a stop: its bytes charged once (not once
    each), and gone, uncharged, when both have ended."""
    async def first():
        store = _store(tmp_path)
        store.serving()
        source = _put(store, "", [line(f"r{i}", {"prompt": "x", "hold": True}) for i in range(2)], tmp_path)
        a, b = _make(store, "", source), _make(store, "", source)
        await _until(lambda: len(store.app.seen) >= 1)
        store.delete_file("", source)
        await store.close()
        return a["id"], b["id"]

    ids = asyncio.run(first())

    async def second():
        store = _store(tmp_path)
        on_disk = sum(p.stat().st_size for p in tmp_path.iterdir() if not p.name.endswith(".json"))
        assert store.used == store.owned[""] == on_disk
        store.serving()
        store.app.gate.set()
        await _until(lambda: all(store.get("", i)["status"] == "completed" for i in ids))
        on_disk = sum(p.stat().st_size for p in tmp_path.iterdir() if not p.name.endswith(".json"))
        assert store.used == on_disk and all(f.info["purpose"] == "batch_output" for f in store.files.values())
        await store.close()

    asyncio.run(second())


def test_each_tokens_files_and_batches_are_counted_apart(tmp_path, monkeypatch):
    """The store's counts are each token's even share (as its bytes are): a token at its share of files, or of
    batches not ended, is refused while another's are taken; at its share of kept batches its own oldest ended
    one makes way, never another's."""
    monkeypatch.setattr(openai_batches, "MAX_KEPT", 4)
    monkeypatch.setattr(openai_batches, "MAX_PENDING", 2)

    async def scenario():
        store = _store(tokens=("alice", "bob"))
        store.serving()
        theirs = _make(store, "token1", _put(store, "token1", [line("b", {"prompt": "b"})], tmp_path))
        await _until(lambda: store.get("token1", theirs["id"])["status"] == "completed")
        held = _make(store, "token0", _put(store, "token0", [line("a", {"prompt": "x", "hold": True})], tmp_path))
        with pytest.raises(HTTPError) as e:  # (one batch not ended is alice's share of 2)
            _make(store, "token0", next(iter(f for f, v in store.files.items() if v.owner == "token0")))
        assert e.value.status == 429 and "at most 1 batches not ended" in e.value.message
        with pytest.raises(HTTPError) as e:  # (alice keeps 2 files: her input and her share)
            _put(store, "token0", [line("c", {"prompt": "c"})], tmp_path)
            store._check_open("token0")
        assert e.value.status == 429 and "at most 2 files are kept for each caller" in e.value.message
        again = _make(store, "token1", theirs["input_file_id"])  # (bob's share of batches is his own)
        await _until(lambda: store.get("token1", again["id"])["status"] == "completed")
        store.app.gate.set()
        await _until(lambda: store.get("token0", held["id"])["status"] == "completed")
        source = next(iter(f for f, v in store.files.items() if v.owner == "token0" and v.info["purpose"] == "batch"))
        for _ in range(3):  # (alice's own ended batches make way for hers)
            b = _make(store, "token0", source)
            await _until(lambda b=b: store.get("token0", b["id"])["status"] == "completed")
        assert store.get("token1", theirs["id"])["status"] == "completed"
        assert sum(j.owner == "token0" for j in store.jobs.values()) == 2
        await store.close()

    asyncio.run(scenario())


def test_a_batch_dir_is_one_servers_at_a_time(tmp_path):
    """Two servers on one --batch-dir would both run its batches: the second is refused until the first stops."""
    async def scenario():
        first = _store(tmp_path)
        with pytest.raises(InvalidConfig, match="--batch-dir: .* is another running server's"):
            _store(tmp_path)
        await first.close()
        second = _store(tmp_path)
        await second.close()

    asyncio.run(scenario())


async def _stopped_with_two_of_four_answered(tmp_path) -> str:
    """A store on `tmp_path` that ran two of a batch's four lines (the third held) and stopped: the batch's id."""
    store = _store(tmp_path)
    store.serving()
    b = _make(store, "", _put(store, "", [line(f"r{i}", {"prompt": "x", "hold": i == 2}) for i in range(4)], tmp_path))
    await _until(lambda: store.get("", b["id"])["request_counts"]["completed"] == 2)
    await store.close()
    return b["id"]


def test_a_batch_taken_back_and_cancelled_before_the_server_serves_keeps_what_ran(tmp_path):
    batch_id = asyncio.run(_stopped_with_two_of_four_answered(tmp_path))

    async def second():
        store = _store(tmp_path)
        ended = store.cancel("", batch_id)
        assert ended["status"] == "cancelled" and ended["request_counts"]["completed"] == 2
        assert len(store.content("", ended["output_file_id"]).path.read_text().splitlines()) == 2
        store.serving()
        await asyncio.sleep(0.1)
        assert store.app.seen == [] and store.get("", batch_id)["status"] == "cancelled"
        await store.close()

    asyncio.run(second())


def test_a_server_stopped_mid_batch_goes_on_with_it_when_started_on_the_same_batch_dir(tiny_gguf_path, config_path,
                                                                                       tmp_path):
    lines = [line(f"r{i}", {"prompt": [5, 6, 7], "max_tokens": 48, "ignore_eos": True, "temperature": 0}) for i in range(24)]
    first = http_server(tiny_gguf_path, config_path, "--batch-dir", str(tmp_path))
    s = next(first)
    oai = openai.OpenAI(base_url=s.http + "/v1", api_key="unused", max_retries=0)
    upload, b = started_with_one_answered(oai, "in.jsonl", lines)
    first.close()  # (SIGTERM, exit status 0)
    stopped = json.loads((tmp_path / f"{b.id}.json").read_text())["info"]
    assert stopped["status"] == "in_progress" and 1 <= stopped["request_counts"]["completed"] < 24, stopped
    for s in http_server(tiny_gguf_path, config_path, "--batch-dir", str(tmp_path)):
        oai = openai.OpenAI(base_url=s.http + "/v1", api_key="unused", max_retries=0)
        assert oai.files.retrieve(upload.id).bytes == upload.bytes
        done = wait_ended(oai, b.id)
        assert done.status == "completed" and done.request_counts.completed == 24, done
        out = [json.loads(x) for x in oai.files.content(done.output_file_id).text.splitlines()]
        assert sorted(o["custom_id"] for o in out) == sorted(x["custom_id"] for x in lines)
        texts = {o["response"]["body"]["choices"][0]["text"] for o in out}
        assert len(texts) == 1 and len(next(iter(texts))) > 0  # (greedy: the answers after the restart are the same)


def test_a_batch_whose_window_passed_while_the_server_was_stopped_expires_keeping_what_ran(tmp_path):
    batch_id = asyncio.run(_stopped_with_two_of_four_answered(tmp_path))
    record = json.loads((tmp_path / f"{batch_id}.json").read_text())
    record["info"]["expires_at"] = int(time.time()) - 1
    (tmp_path / f"{batch_id}.json").write_text(json.dumps(record))

    async def second():
        store = _store(tmp_path)
        store.serving()
        await _until(lambda: store.get("", batch_id)["status"] == "expired")
        ended = store.get("", batch_id)
        assert ended["request_counts"]["completed"] == 2 and store.app.seen == []
        assert len(store.content("", ended["output_file_id"]).path.read_text().splitlines()) == 2
        on_disk = sum(p.stat().st_size for p in tmp_path.iterdir() if not p.name.endswith(".json"))
        assert store.used == on_disk
        await store.close()

    asyncio.run(second())
