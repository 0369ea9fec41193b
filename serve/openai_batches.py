"""OpenAI's Files and Batch APIs: batch files uploaded, batches run in the server's background through the
HTTP API's own handlers (serve.batch.run_lines, as `jaxcb run-batch` runs a file), their output and error
files read back.

    POST   /v1/files                  multipart: file, purpose "batch" -> the file's object
    GET    /v1/files                  ?purpose= &limit= &after= &order= -> a list
    GET    /v1/files/{id}             its object; DELETE it
    GET    /v1/files/{id}/content     its bytes
    POST   /v1/batches                {input_file_id, endpoint, completion_window: "24h", metadata} -> the batch
    GET    /v1/batches                ?limit= &after= -> a list, newest first
    GET    /v1/batches/{id}           the batch: status, request_counts, output_file_id, error_file_id
    POST   /v1/batches/{id}/cancel    cancelling, then cancelled (what ran is in its files)

Files are kept on disk, at most --batch-files-mb in all (input, output and error files together; an upload
past what is left is a 413); a server with bearer tokens keeps each token's files and batches apart
(another's id is not found), each token within an even share of the limit; one without keeps one store for
every client. A batch is validated whole first, as OpenAI validates it (each line a request to the batch's
endpoint, custom_ids unique, at most MAX_BATCH_REQUESTS): any bad line fails the batch, the lines listed in
its `errors`. Then its lines run, BATCH_IN_FLIGHT at once, through the server's admission like any client's
requests; each owner's batches one at a time, in the order they were made, and different owners' side by
side; a line refused because the server is full (429) waits and is sent again, so a batch gives way to
interactive traffic and loses nothing. Each answer goes to the output file (status 200) or the error file, in
input order, as OpenAI splits them. A batch reads its input file to its end even if the file is deleted
meanwhile (the file's bytes stay charged to its owner until then).

Where the files live: without --batch-dir, in a folder of the server's own, removed when it stops (batches
still running are then cancelled). With --batch-dir DIR they outlive the server: each file and batch is
DIR/<id>.json beside the file's bytes (DIR/<file id>), written whenever the batch changes state (through a
temporary file and a rename), and every answer line is flushed as it is written. A server started on the
folder takes its files and batches back: a batch that was validating is validated again, one in progress
goes on, its answers so far read back (a torn last line dropped) and the lines they answer not run again
(lines in flight when it stopped run again: a crash costs their work, never an answer twice); one that was
being cancelled ends cancelled. Owners are kept as their token's SHA-256, never the token: a record whose
token the server no longer has is left on disk, unread. A folder is one running server's at a time (a lock on
DIR/.lock): two would both run its batches.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import fcntl
import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import stat
import tempfile
import time
import uuid
from pathlib import Path

from fastapi.responses import FileResponse
from python_multipart.multipart import MultipartParser, parse_options_header

from jaxcb.host.errors import InvalidConfig, shown
from serve import batch
from serve.openai_fields import HTTPError, bad_request, check_fields, check_metadata, list_page, list_query, str_field

log = logging.getLogger("jaxcb.serve.openai_batches")
MAX_FILE_BYTES = 200 << 20  # one uploaded file (OpenAI's limit for a batch's input)
MAX_BATCH_REQUESTS = 50_000  # lines in one batch (OpenAI's)
MAX_ERRORS_LISTED = 100  # a failed validation's errors
BATCH_IN_FLIGHT = 64  # a batch's lines running at once
MAX_KEPT = 10_000  # files, and batches, kept at once (a caller's oldest finished batch is dropped first); and
MAX_PENDING = 100  # batches not ended at once (each waits its turn): both shared evenly by the bearer tokens (_cap)
MAX_ORDER = 1 << 17  # the places of ids made, deleted ones too, for list cursors (the oldest forgotten first)
BATCH_FIELDS = {"input_file_id", "endpoint", "completion_window", "metadata", "output_expires_after"}
UPLOAD_FIELDS = ("file", "purpose", "expires_after[anchor]", "expires_after[seconds]")
ENDED = ("failed", "completed", "expired", "cancelled")
_OURS = re.compile(r"\.?(file-|batch_)[0-9a-f]{32}(\.json(\.tmp)?)?")  # what a --batch-dir's store writes
DELETED = {"code": "file_deleted", "message": "input_file_id: the file was deleted before the batch ran",
           "param": "input_file_id", "line": None}


@dataclasses.dataclass
class File:
    owner: str
    path: Path
    info: dict  # the file object as the API gives it


@dataclasses.dataclass
class Job:
    owner: str
    info: dict  # the batch object as the API gives it
    headers: dict  # its owner's authorization, sent with each line
    source: Path  # its input file's bytes (kept until it ends, even if the file is deleted)
    writing: dict[str, Path] = dataclasses.field(default_factory=dict)  # "output"/"error" -> its file being written
    task: asyncio.Task | None = None
    tally: batch.Tally | None = None


class Batches:
    """The files and batches of one server (the module's doc). `app` is set once the app is made: the lines
    go through it."""

    def __init__(self, limit_bytes: int, header_timeout_s: float, tokens: tuple[str, ...] = (),
                 folder: str | None = None):
        self.limit, self.timeout, self.tokens = limit_bytes, header_timeout_s, tokens
        # owner (frontend.owner's tokenN) -> its token's SHA-256, what its records name it by, and back
        self.keys = {f"token{i}": hashlib.sha256(t.encode()).hexdigest() for i, t in enumerate(tokens)}
        self.owners = {key: owner for owner, key in self.keys.items()}
        self.share = limit_bytes // max(1, len(tokens))  # each owner's part (the server's bearer tokens share it evenly)
        self.used = 0  # bytes of the files kept, uploading and being written (each charged as it comes)
        self.owned: collections.Counter[str] = collections.Counter()  # owner -> its part of `used`
        self.uploading: collections.Counter[str] = collections.Counter()  # owner -> its uploads under way
        self.files: dict[str, File] = {}
        self.jobs: dict[str, Job] = {}
        self.order: collections.OrderedDict[str, int] = collections.OrderedDict()  # id -> its place (_made)
        self._seq = itertools.count()
        self.app = None
        self.runs: dict[str, list[asyncio.Task]] = {}  # owner -> its batches' runs not ended (a new one waits for them)
        self.stopping = False  # the server stops: with a folder of its own, a batch interrupted is cancelled
        self.ready = asyncio.Event()  # the server serves: batches run (serving)
        self.durable = folder is not None
        self.folder: Path | None = None
        if folder is not None:
            self.folder = Path(folder)
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                self._lock = open(self.folder / ".lock", "a")  # (held while the process lives)
            except OSError as e:
                raise InvalidConfig(f"--batch-dir: {folder!r} cannot hold the batches' files ({e})") from None
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                self._lock.close()
                raise InvalidConfig(f"--batch-dir: {folder!r} is another running server's (two would both run "
                                    "its batches)") from None
            try:
                self._load()
            except OSError as e:
                raise InvalidConfig(f"--batch-dir: {folder!r} cannot hold the batches' files ({e})") from None

    # ---- files ----
    def _new_path(self, file_id: str) -> Path:
        if self.folder is None:
            self.folder = Path(tempfile.mkdtemp(prefix="jaxcb-files-"))
        return self.folder / file_id

    def _file(self, owner: str, file_id: str, field: str = "file_id") -> File:
        f = self.files.get(file_id)
        if f is None or f.owner != owner:
            raise HTTPError(404, f"{field}: no file {shown(file_id)}", param=field)
        return f

    def _room(self, owner: str) -> int:
        """The bytes `owner` may still add: within the whole limit and its share of it."""
        return max(0, min(self.limit - self.used, self.share - self.owned[owner]))

    def _charge(self, owner: str, size: int) -> None:
        self.used += size
        self.owned[owner] += size

    def _keep(self, owner: str, path: Path, size: int, filename: str, purpose: str) -> dict:
        file_id = path.name
        info = {"id": file_id, "object": "file", "bytes": size, "created_at": int(time.time()), "filename": filename,
                "purpose": purpose, "status": "processed", "expires_at": None, "status_details": None}
        self.files[file_id] = File(owner, path, info)  # (its bytes charged as they were written)
        self._made(file_id)
        self._save(file_id, {"kind": "file", "owner": self._key(owner), "place": self.order[file_id], "info": info})
        return info

    # ---- owners, and the records kept in a --batch-dir ----
    def _key(self, owner: str) -> str:
        """An owner as its record names it: its token's SHA-256 (never the token), "" for every client."""
        return self.keys[owner] if owner else ""

    def _owner(self, key: str) -> str | None:
        """The owner a record's key names on this server (None: a token it no longer has)."""
        if not key:
            return None if self.tokens else ""
        return self.owners.get(key)

    def _headers(self, owner: str) -> dict:
        """What a batch's lines carry: its owner's authorization (frontend.owner's tokenN is the Nth token)."""
        return {"authorization": f"Bearer {self.tokens[int(owner[5:])]}"} if owner else {}

    def _save(self, key: str, record: dict) -> None:
        if self.durable:
            temporary = self.folder / f".{key}.json.tmp"
            with open(temporary, "w") as f:
                f.write(json.dumps(record))
                f.flush()
                os.fsync(f.fileno())  # (a power cut leaves the old record or the new one, never an empty one)
            os.replace(temporary, self.folder / f"{key}.json")

    def _forget(self, key: str) -> None:
        if self.durable:
            (self.folder / f"{key}.json").unlink(missing_ok=True)

    def _save_job(self, job: Job) -> None:
        self._save(job.info["id"], {"kind": "batch", "owner": self._key(job.owner), "place": self.order.get(job.info["id"], -1),
                                    "info": self._shown(job),
                                    "source": job.source.name, "writing": {k: p.name for k, p in job.writing.items()}})

    def _made(self, key: str) -> None:
        """`key` (a file's or a batch's id) made now: its place in the lists, kept after it is deleted (a cursor
        that names it still pages on: the SDK's list-and-delete loop)."""
        self.order[key] = next(self._seq)
        while len(self.order) > MAX_ORDER:
            self.order.popitem(last=False)

    def _cap(self, total: int) -> int:
        """Each owner's part of a server-wide count (the bearer tokens share it evenly, as they share the bytes):
        no owner's files or batches crowd out another's."""
        return max(1, total // max(1, len(self.tokens)))

    def _check_open(self, owner: str) -> None:
        if not self.limit:
            raise HTTPError(400, "the server keeps no files (--batch-files-mb 0)", param="file")
        mine = sum(f.owner == owner for f in self.files.values()) + self.uploading[owner]
        if mine >= self._cap(MAX_KEPT):
            raise HTTPError(429, f"at most {self._cap(MAX_KEPT)} files are kept for each caller (with uploads under "
                                 "way); delete some first")

    async def upload(self, owner: str, request) -> dict:
        """POST /v1/files: the multipart body streamed to disk within the room left (a 413 past it), each chunk
        within --http-header-timeout of the last (a 408)."""
        self._check_open(owner)
        kind, params = parse_options_header(request.headers.get("content-type", ""))
        if kind != b"multipart/form-data" or not params.get(b"boundary"):
            raise bad_request("body: must be multipart/form-data with the file and its purpose (OpenAI's files.create)")
        room = min(MAX_FILE_BYTES, self._room(owner))
        declared = request.headers.get("content-length")
        if declared is not None and declared.isascii() and declared.isdigit() and (
                len(declared) > 15 or int(declared) > room + (1 << 16)):
            raise self._too_large(int(declared[:16]), owner)
        path = self._new_path(f"file-{uuid.uuid4().hex}")
        upload = _Upload(path, self, owner)
        self.uploading[owner] += 1  # (its place taken now: uploads at once do not pass the cap together)
        try:
            parser = MultipartParser(params[b"boundary"], upload.callbacks(), max_header_count=8)
            chunks = request.stream().__aiter__()
            while True:
                try:
                    chunk = await asyncio.wait_for(chunks.__anext__(), self.timeout)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    raise HTTPError(408, f"body: no bytes came for {self.timeout:g} s", param="body") from None
                parser.write(chunk)
                if upload.error is not None:
                    raise upload.error
            parser.finalize()
            if upload.error is not None:
                raise upload.error
            if upload.filename is None:
                raise bad_request("file: missing (a multipart part named file, with its filename)")
            purpose = upload.fields.get("purpose")
            if purpose != "batch":
                raise bad_request(f"purpose: {shown(purpose)} is not kept here; only \"batch\" files are")
            upload.close()
            return self._keep(owner, path, upload.size, upload.filename, purpose)
        except BaseException as e:
            upload.close()
            self._charge(owner, -upload.size)
            upload.size = 0
            path.unlink(missing_ok=True)
            if isinstance(e, Exception) and not isinstance(e, HTTPError):  # python-multipart's: a malformed body
                raise bad_request(f"body: not a well-formed multipart body ({str(e)[:200]})") from None
            raise
        finally:
            self.uploading[owner] -= 1

    def _too_large(self, size: int, owner: str) -> HTTPError:
        return HTTPError(413, f"file: {size} bytes; the room left is {min(MAX_FILE_BYTES, self._room(owner))} bytes (a "
                              f"file at most {MAX_FILE_BYTES}; all files at most --batch-files-mb, {self.limit}, each "
                              f"token's at most {self.share}: this caller's use {self.owned[owner]}, all {self.used})",
                         param="file")

    def list_files(self, owner: str, query) -> dict:
        purpose = query.get("purpose")
        rows = [f.info for f in self.files.values() if f.owner == owner and purpose in (None, f.info["purpose"])]
        return _page(rows, self.order, query, "file", {"purpose"}, most=MAX_KEPT, default=MAX_KEPT)

    def get_file(self, owner: str, file_id: str) -> dict:
        return self._file(owner, file_id).info

    def delete_file(self, owner: str, file_id: str) -> dict:
        f = self._file(owner, file_id)
        del self.files[file_id]
        self._forget(file_id)
        if not self._reading(f.path):  # (else the batch reading it removes it when it ends: _let_go)
            self._charge(owner, -f.info["bytes"])
            f.path.unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}

    def content(self, owner: str, file_id: str) -> FileResponse:
        f = self._file(owner, file_id)
        return FileResponse(f.path, media_type="application/octet-stream", filename=f.info["filename"])

    # ---- batches ----
    def _reading(self, path: Path) -> bool:
        return any(j.source == path and j.info["status"] not in ENDED for j in self.jobs.values())

    def _let_go(self, job: Job) -> None:
        """A batch ended: its input's bytes go if the file was deleted meanwhile and no other batch reads them."""
        if job.source.name not in self.files and not self._reading(job.source) and job.source.exists():
            self._charge(job.owner, -job.source.stat().st_size)
            job.source.unlink(missing_ok=True)

    def create(self, owner: str, body: dict) -> dict:
        check_fields(body, BATCH_FIELDS)
        for field in ("input_file_id", "endpoint", "completion_window"):
            if field not in body:
                raise bad_request(f"{field}: required")
        source = self._file(owner, str_field(body, "input_file_id", ""), "input_file_id")
        if source.info["purpose"] != "batch":
            raise bad_request(f"input_file_id: {shown(source.info['id'])} is not a batch file")
        endpoint = str_field(body, "endpoint", None)
        if endpoint not in batch.URLS:
            raise bad_request(f"endpoint: {shown(endpoint)} is not a batch call; one of {', '.join(batch.URLS)}")
        window = str_field(body, "completion_window", None)
        if window != "24h":
            raise bad_request(f"completion_window: {shown(window)}; only \"24h\" is offered")
        check_metadata(body.get("metadata"))
        mine = [k for k, j in self.jobs.items() if j.owner == owner]
        if sum(self.jobs[k].info["status"] not in ENDED for k in mine) >= self._cap(MAX_PENDING):
            raise HTTPError(429, f"at most {self._cap(MAX_PENDING)} batches not ended are taken from each caller; "
                                 "wait for one to end")
        ended = [k for k in mine if self.jobs[k].info["status"] in ENDED]
        while len(mine) >= self._cap(MAX_KEPT):  # the caller's own oldest ended batch makes way
            dropped = ended.pop(0)
            mine.remove(dropped)
            del self.jobs[dropped]
            self._forget(dropped)
        self._go_on()
        now = int(time.time())
        info = {"id": f"batch_{uuid.uuid4().hex}", "object": "batch", "endpoint": endpoint, "errors": None,
                "input_file_id": source.info["id"], "completion_window": window, "status": "validating",
                "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
                "expires_at": now + 24 * 3600, "finalizing_at": None, "completed_at": None, "failed_at": None,
                "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": body.get("metadata"),
                "model": None, "usage": None}
        job = Job(owner, info, self._headers(owner), source.path)
        self.jobs[info["id"]] = job
        self._made(info["id"])
        self._save_job(job)
        self._start(job)
        return self._shown(job)

    def _job(self, owner: str, batch_id: str) -> Job:
        job = self.jobs.get(batch_id)
        if job is None or job.owner != owner:
            raise HTTPError(404, f"batch_id: no batch {shown(batch_id)}", param="batch_id")
        return job

    def _shown(self, job: Job) -> dict:
        if job.tally is not None and job.info["status"] in ("in_progress", "cancelling", "finalizing"):
            counts = job.info["request_counts"]
            counts["completed"], counts["failed"] = job.tally.answered, job.tally.failed
            job.info["usage"], job.info["model"] = job.tally.usage(), job.tally.model
        return dict(job.info)

    def get(self, owner: str, batch_id: str) -> dict:
        return self._shown(self._job(owner, batch_id))

    def list(self, owner: str, query) -> dict:
        rows = [self._shown(j) for j in self.jobs.values() if j.owner == owner]
        return _page(rows, self.order, query, "batch", set(), most=100, default=20)

    def cancel(self, owner: str, batch_id: str) -> dict:
        job = self._job(owner, batch_id)
        if job.info["status"] in ENDED:
            raise HTTPError(409, f"batch_id: batch {shown(batch_id)} is {job.info['status']}; only a batch not ended "
                                 "is cancelled", param="batch_id")
        if job.info["status"] != "cancelling":
            job.info["status"], job.info["cancelling_at"] = "cancelling", int(time.time())
            self._save_job(job)
            if job.task is None:  # (taken back from --batch-dir, the server not serving yet)
                self._end_taken_back(job)
            else:
                job.task.cancel()
        return self._shown(job)

    def serving(self) -> None:
        """The server serves (its warm-up done): batches run (one made during the warm-up waited: its lines would
        have been refused), and those taken back from --batch-dir that had not ended go on (_load)."""
        self.ready.set()
        self._go_on()

    def _go_on(self) -> None:
        """The batches taken back and not ended run (before any made since: each owner's run in order)."""
        for job in self.jobs.values():
            if job.task is None and job.info["status"] in ("validating", "in_progress"):
                self._start(job)

    async def close(self) -> None:
        """The server stops. Without --batch-dir every batch not ended is cancelled and the files go with the
        folder; with it, a running batch stops where it is, to go on when a server starts on the folder."""
        self.stopping = True
        for job in self.jobs.values():
            if job.task is not None and not job.task.done():
                if not self.durable:
                    job.info["status"], job.info["cancelling_at"] = "cancelling", int(time.time())
                job.task.cancel()
        tasks = [j.task for j in self.jobs.values() if j.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        if self.folder is not None and not self.durable:
            shutil.rmtree(self.folder, ignore_errors=True)
        if self.durable:
            self._lock.close()  # (the lock goes with it: another server may take the folder)

    def _start(self, job: Job) -> None:
        """`job` runs after every batch its owner made before it has ended (it is validated at once, its lines run
        in its turn; one before it that fails or is cancelled early does not let it pass one still running)."""
        before = [t for t in self.runs.get(job.owner, ()) if not t.done()]
        job.task = asyncio.ensure_future(self._run(job, before))
        self.runs[job.owner] = [*before, job.task]

    async def _run(self, job: Job, before: list[asyncio.Task]) -> None:
        info, outputs = job.info, {}  # kind -> [path, file, bytes]
        try:
            if info["status"] == "validating":
                errors, total = await asyncio.to_thread(_validate, job.source, info["endpoint"])
                if errors:
                    info["errors"] = {"object": "list", "data": errors}
                    info["status"], info["failed_at"] = "failed", int(time.time())
                    return
                info["request_counts"]["total"] = total
                info["status"], info["in_progress_at"] = "in_progress", int(time.time())  # (its turn may wait)
                self._save_job(job)
            async with asyncio.timeout(max(0.0, info["expires_at"] - time.time())):
                if before:
                    await asyncio.wait(before)
                await self.ready.wait()
                # (the input opened only now: batches waiting hold no open file)
                try:
                    source = open(job.source, "rb")
                except FileNotFoundError:
                    info["errors"] = {"object": "list", "data": [DELETED]}
                    info["status"], info["failed_at"] = "failed", int(time.time())
                    return
                with source:
                    tally, answered = batch.Tally(), set()
                    for kind in ("output", "error"):  # (a batch taken back goes on with its files)
                        kept = job.writing.get(kind) or self._new_path(f"file-{uuid.uuid4().hex}")
                        size = await asyncio.to_thread(_read_back, kept, tally, answered)
                        outputs[kind] = [kept, open(kept, "ab"), size]
                    job.tally = tally  # (once both are read: _keep_outputs reads them again if it ends before)
                    if not job.writing:
                        job.writing = {kind: out[0] for kind, out in outputs.items()}
                        self._save_job(job)

                    def write(out: dict) -> None:
                        line = batch.json_line(out).encode()
                        if len(line) > self._room(job.owner):
                            raise _StoreFull()
                        kept = outputs["output" if out["error"] is None else "error"]
                        kept[1].write(line)
                        if self.durable:  # (a server killed loses no answer written)
                            kept[1].flush()
                        kept[2] += len(line)
                        self._charge(job.owner, len(line))

                    await batch.run_lines(self.app, source, write, BATCH_IN_FLIGHT, job.tally, headers=job.headers,
                                          retry_busy=True, answered=answered)
                    info["status"], info["finalizing_at"] = "finalizing", int(time.time())
                    self._keep_outputs(job, outputs)
                    info["status"], info["completed_at"] = "completed", int(time.time())
        except asyncio.CancelledError:
            if self.durable and self.stopping and info["status"] != "cancelling":
                for _, sink, _ in outputs.values():  # (left as it is, to go on: resume)
                    sink.close()
                self._save_job(job)
                return
            self._keep_outputs(job, outputs)
            info["status"], info["cancelled_at"] = "cancelled", int(time.time())
        except TimeoutError:  # (its completion window passed: what ran is kept, as OpenAI keeps it)
            self._keep_outputs(job, outputs)
            info["status"], info["expired_at"] = "expired", int(time.time())
        except _StoreFull:
            self._keep_outputs(job, outputs)
            info["errors"] = {"object": "list", "data": [{
                "code": "file_store_full", "line": None, "param": None,
                "message": f"the server's files reached --batch-files-mb ({self.limit} bytes) while writing the output"}]}
            info["status"], info["failed_at"] = "failed", int(time.time())
        except Exception as e:  # noqa: BLE001 - the server's fault: the batch fails saying so, never hangs
            log.exception("batch %s failed", info["id"])
            self._keep_outputs(job, outputs)
            info["errors"] = {"object": "list", "data": [{"code": "server_error", "line": None, "param": None,
                                                          "message": f"the batch failed: {e!r}"[:1000]}]}
            info["status"], info["failed_at"] = "failed", int(time.time())
        finally:
            if info["status"] in ENDED:
                self._let_go(job)
                job.tally = None
                self._save_job(job)

    def _keep_outputs(self, job: Job, outputs: dict) -> None:
        """The output and error files written so far become files of the batch's owner (an empty one is none);
        a batch taken back that had not opened its files again (it ends waiting) keeps them as they were."""
        if job.tally is None and job.writing:
            job.tally = batch.Tally()
            for kind, path in job.writing.items():
                if kind in outputs:
                    outputs[kind][1].close()
                outputs[kind] = [path, None, _read_back(path, job.tally, set())]
        if job.tally is not None:
            self._shown(job)  # (the counts as they ended)
        for kind, (path, sink, size) in outputs.items():
            if sink is not None:
                sink.close()
            if size == 0:
                path.unlink(missing_ok=True)
                continue
            info = self._keep(job.owner, path, size, f"{job.info['id']}_{kind}.jsonl", "batch_output")
            job.info[f"{kind}_file_id"] = info["id"]
        outputs.clear()
        job.writing = {}

    def _load(self) -> None:
        """The files and batches a --batch-dir holds, taken back (the module's doc); what no record names goes. A
        record is used only where every name in it is one this store makes (nothing it says reaches outside the
        folder); any other is left as it is, with the bytes it names."""
        records, kept = [], set()
        for path in self.folder.glob("*.json"):
            try:
                if _plain(path) is not True:  # (a link, a pipe: never read)
                    raise ValueError("not a plain file")
                record = json.loads(path.read_text())
                if not _well_formed(record, path.stem):
                    raise ValueError("not in the shape this store writes")
                named = [record.get("source"), *record.get("writing", {}).values(), path.stem if record["kind"] ==
                         "file" else None, record["info"].get("output_file_id"), record["info"].get("error_file_id")]
                if any(name and _plain(self.folder / name) is False for name in named):
                    raise ValueError("it names a file that is a link or not a plain file")
                records.append((record["kind"] != "file", record["place"], path.stem, record))
            except (OSError, ValueError, RecursionError) as e:
                log.warning("--batch-dir: %s is not a record jaxcb wrote (%r); left as it is", path, e)
                kept.add(path.stem)  # (nor are the bytes beside it touched)
        unread, taken = 0, []
        for _, _, key, record in sorted(records, key=lambda r: r[:2]):  # (files first: the batches name them)
            owner = self._owner(record["owner"])
            if owner is None:  # (a token this server does not have: left on disk, unread)
                unread += 1
                kept.update((key, record.get("source", ""), *record.get("writing", {}).values()))
            elif record["kind"] == "file":
                path = self.folder / key
                if not path.is_file():
                    self._forget(key)
                    continue
                record["info"]["bytes"] = path.stat().st_size
                self.files[key] = File(owner, path, record["info"])
                self._charge(owner, record["info"]["bytes"])
                self._made(key)
                kept.add(key)
            else:
                job = Job(owner, record["info"], self._headers(owner), self.folder / record["source"],
                          {kind: self.folder / name for kind, name in record["writing"].items()})
                self.jobs[key] = job
                self._made(key)
                kept.update((key, *(p.name for p in job.writing.values())))
                if job.info["status"] not in ENDED:
                    kept.add(job.source.name)  # (a deleted input still read; an ended batch's goes below)
                taken.append(job)
        held = set()  # deleted inputs still read, each charged once however many batches read it
        for job in taken:
            self._take_back(job, held)
        for job in taken:  # (once every batch is known: one ending lets go of an input no other still reads)
            if job.info["status"] in ("cancelling", "finalizing"):
                self._end_taken_back(job)
        for path in self.folder.iterdir():  # uploads cut short, temporary records, inputs no batch reads
            if path.is_file() and _OURS.fullmatch(path.name) and (
                    path.name.endswith(".tmp") or path.name.split(".")[0] not in kept):
                path.unlink(missing_ok=True)
        if unread:
            log.warning("--batch-dir: %d files and batches of bearer tokens this server does not have are left in %s",
                        unread, self.folder)

    def _take_back(self, job: Job, held: set) -> None:
        """A batch from a --batch-dir: its bytes charged (a deleted input it still reads once, `held`), its output
        files (ended) kept files."""
        info = job.info
        if (job.source.name not in self.files and job.source not in held and job.source.is_file()
                and info["status"] not in ENDED):
            held.add(job.source)
            self._charge(job.owner, job.source.stat().st_size)  # (a deleted input still read)
        for kind in ("output", "error"):  # (the server stopped between the batch's record and the file's own)
            file_id = info.get(f"{kind}_file_id")
            path = self.folder / file_id if file_id else None
            if path is not None and file_id not in self.files and path.is_file():
                self._charge(job.owner, path.stat().st_size)
                self._keep(job.owner, path, path.stat().st_size, f"{info['id']}_{kind}.jsonl", "batch_output")
        for path in job.writing.values():  # (a torn last line dropped here: what is charged is what stays)
            self._charge(job.owner, _read_back(path, batch.Tally(), set()))

    def _end_taken_back(self, job: Job) -> None:
        """A batch taken back that will not run again ends with what it wrote: cancelled, or completed if it
        had run every line (finalizing)."""
        ended = "completed" if job.info["status"] == "finalizing" else "cancelled"
        self._keep_outputs(job, {})
        job.info["status"], job.info[f"{ended}_at"] = ended, int(time.time())
        job.tally = None
        self._let_go(job)
        self._save_job(job)


class _StoreFull(Exception):
    pass


class _Upload:
    """python-multipart's callbacks for an upload: the `file` part to `path` (within the store's room, its
    bytes charged to its owner as they come), the other parts (UPLOAD_FIELDS, each at most 256 bytes)
    as text. `error`: the first thing wrong."""

    def __init__(self, path: Path, store: "Batches", owner: str):
        self.path, self.store, self.owner = path, store, owner
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.size = 0
        self.error: HTTPError | None = None
        self.sink = None
        self._header, self._value, self._part, self._data = b"", b"", None, bytearray()

    def callbacks(self) -> dict:
        return {"on_part_begin": self._begin, "on_header_field": self._field, "on_header_value": self._header_value,
                "on_header_end": self._header_end, "on_headers_finished": self._headers_done,
                "on_part_data": self._part_data, "on_part_end": self._end}

    def _begin(self):
        self._part, self._data = None, bytearray()

    def _field(self, data, start, end):
        self._header += data[start:end]

    def _header_value(self, data, start, end):
        self._value += data[start:end]

    def _header_end(self):
        if self._header.strip().lower() == b"content-disposition":
            _, params = parse_options_header(self._value)
            self._part = params.get(b"name", b"").decode("utf-8", "replace")
            if self._part == "file":
                self.filename = params.get(b"filename", b"").decode("utf-8", "replace")[:255] or "upload.jsonl"
        self._header, self._value = b"", b""

    def _headers_done(self):
        if self.error is not None:
            return
        if self._part not in UPLOAD_FIELDS:
            self.error = bad_request(f"{shown(self._part)}: not a field of an upload (it has file and purpose)")
        elif self._part == "file" and self.sink is None:
            self.sink = open(self.path, "wb")
        elif self._part == "file" or self._part in self.fields:
            self.error = bad_request(f"{self._part}: given twice")

    def _part_data(self, data, start, end):
        if self.error is not None:
            return
        if self._part == "file":
            if end - start > self.store._room(self.owner) or self.size + end - start > MAX_FILE_BYTES:
                self.error = self.store._too_large(self.size + end - start, self.owner)
                return
            self.size += end - start
            self.store._charge(self.owner, end - start)
            self.sink.write(data[start:end])
        else:
            self._data += data[start:end]
            if len(self._data) > 256:
                self.error = bad_request(f"{self._part}: longer than 256 bytes")

    def _end(self):
        if self.error is None and self._part in UPLOAD_FIELDS and self._part != "file":
            self.fields[self._part] = self._data.decode("utf-8", "replace")

    def close(self):
        if self.sink is not None:
            self.sink.close()


_FILE_NAME = re.compile(r"file-[0-9a-f]{32}")
STATUSES = ("validating", "in_progress", "finalizing", "cancelling", *ENDED)


def _well_formed(record, stem: str) -> bool:
    """Whether a --batch-dir record is in the shape this store writes, every name in it one it makes."""
    if not isinstance(record, dict) or not isinstance(record.get("info"), dict):
        return False
    info, kind = record["info"], record.get("kind")
    if (kind not in ("file", "batch") or info.get("id") != stem or not isinstance(record.get("owner"), str)
            or not isinstance(record.get("place"), int)):
        return False
    if kind == "file":
        return (_FILE_NAME.fullmatch(stem) is not None and isinstance(info.get("filename"), str)
                and isinstance(info.get("purpose"), str) and isinstance(info.get("created_at"), int))
    writing, counts = record.get("writing"), info.get("request_counts")
    return (re.fullmatch(r"batch_[0-9a-f]{32}", stem) is not None and info.get("status") in STATUSES
            and isinstance(record.get("source"), str) and _FILE_NAME.fullmatch(record["source"]) is not None
            and isinstance(writing, dict) and set(writing) <= {"output", "error"}
            and all(isinstance(v, str) and _FILE_NAME.fullmatch(v) for v in writing.values())
            and all(info.get(f"{k}_file_id") is None or (isinstance(info[f"{k}_file_id"], str)
                                                         and _FILE_NAME.fullmatch(info[f"{k}_file_id"]))
                    for k in ("output", "error"))
            and isinstance(counts, dict) and all(isinstance(counts.get(k), int) for k in ("total", "completed", "failed"))
            and isinstance(info.get("expires_at"), int) and isinstance(info.get("endpoint"), str)
            and isinstance(info.get("created_at"), int))


def _plain(path: Path) -> bool | None:
    """Whether `path` is a plain file of its own (None: there is nothing; False: a link, a folder, a pipe, ...)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return None


def _read_back(path: Path, tally: batch.Tally, answered: set) -> int:
    """An output file a batch was writing when its server stopped: its lines counted in `tally`, their
    custom_ids added to `answered`, and what follows the last whole line (torn by a crash) cut off; its size."""
    if not path.is_file():
        return 0
    good = 0
    with open(path, "rb+") as f:
        for raw in f:
            try:
                out = json.loads(raw) if raw.endswith(b"\n") else None
            except ValueError:
                out = None
            if not isinstance(out, dict) or "response" not in out or "error" not in out:
                break
            tally.count(out)
            answered.add(out.get("custom_id"))
            good += len(raw)
        f.truncate(good)
    return good


def _validate(path: Path, endpoint: str) -> tuple[list[dict], int]:
    """A batch file's errors, as OpenAI's validation lists them (at most MAX_ERRORS_LISTED), and its lines."""
    errors, seen, total = [], set(), 0
    try:
        source = open(path, "rb")
    except FileNotFoundError:
        return [DELETED], 0
    with source:
        for number, raw in batch.lines(source):
            total += 1
            try:
                _, url, _ = batch.read_request(raw, seen)
                if url != endpoint:
                    raise batch.LineError("mismatched_endpoint", f"url: {shown(url)} is not the batch's endpoint "
                                                                 f"{shown(endpoint)}")
            except batch.LineError as e:
                if len(errors) < MAX_ERRORS_LISTED:
                    errors.append({"code": e.code, "message": e.message, "param": None, "line": number})
    if total > MAX_BATCH_REQUESTS:
        errors.insert(0, {"code": "too_many_requests", "message": f"the file has {total} requests; a batch has at most "
                                                                  f"{MAX_BATCH_REQUESTS}", "param": None, "line": None})
    if total == 0:
        errors.append({"code": "empty_file", "message": "the file has no requests", "param": None, "line": None})
    return errors, total


def _page(rows: list[dict], order_of: dict, query, what: str, more: set, most: int, default: int) -> dict:
    """A list call's page, newest first (OpenAI's: `limit` 1 to `most`, `order` desc or asc, `after` an id, which
    may have been deleted since: its place, `order_of`; the list's own `more` parameters)."""
    limit, order = list_query(query, more, most, default)
    rows = rows[::-1] if order == "desc" else rows  # (`rows` in the order they were made)
    start = 0
    if "after" in query:
        at = order_of.get(query["after"])
        if at is None:
            raise bad_request(f"after: no {what} {shown(query['after'])}")
        place = [order_of.get(r["id"], -1) for r in rows]  # (one made before every place kept: the oldest)
        start = next((i for i, p in enumerate(place) if (p < at if order == "desc" else p > at)), len(rows))
    page = rows[start:start + limit]
    return list_page(page, start + len(page) < len(rows))
