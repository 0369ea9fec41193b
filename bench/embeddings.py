"""Embeddings throughput over HTTP: `jaxcb serve` against vLLM's CPU backend (`vllm serve --runner pooling
--convert embed`), the same inputs as token ids, all sent at once, trials interleaved; prints inputs/s and prompt
tokens/s of each, and how close their vectors are (cosine; both pool the last token, L2-normalized). Every
trial sends inputs neither server has seen (no prefix-cache hits), the same lengths each time.

    python -m bench.embeddings [--model smollm2-135m] [--inputs 256] [--trials 2]
                               [--vllm-python /tmp/peers/vllm-cpu/bin/python --vllm-model /tmp/peers/smollm2-hf]

With `--task rerank`, the model read as a cross-encoder by its logits of "no" and "yes" (jaxcb's
`--classifier-from-tokens no,yes`; vLLM's `--convert classify` with `classifier_from_token` and the
`from_2_way_softmax` method, as vLLM serves the original Qwen3-Reranker): `--inputs` /rerank requests at once, each
a query against `--documents` documents of random words (fresh each trial); prints pairs/s, prompt tokens/s (as
jaxcb counts them) and the largest difference between the two servers' relevance scores.

The vLLM side is optional (../shared/peers/setup-vllm-cpu.sh installs it); without it only jaxcb is measured.
Each server is started once, before the trials, and both stay up while the others' trials run. The last line
printed is JSON.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

# vllm-cpu's CLI asks importlib.metadata for "vllm" (its distribution is "vllm-cpu"): started through a shim
VLLM_SHIM = ("import importlib.metadata as m, sys; v = m.version; "
             "m.version = lambda n: v('vllm-cpu') + '+cpu' if n == 'vllm' else v(n); "
             "sys.argv[0] = 'vllm'; from vllm.entrypoints.cli.main import main; main()")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        name = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name"))
        family = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("cpu family"))
        model = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model\t"))
        return f"{name} (family {family} model {model}), {os.cpu_count()} cores"
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


class Server:
    """A server process (its log in a temporary directory), ready once its /health answers 200."""

    def __init__(self, name: str, cmd: list[str], port: int, env: dict | None = None, timeout: float = 900):
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.work = tempfile.mkdtemp(prefix=f"bench-embeddings-{name}-")
        self.log = open(os.path.join(self.work, "server.log"), "w")
        env = dict(os.environ, TMPDIR=self.work, **(env or {}))
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        t0 = time.perf_counter()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}; log: {self.log.name}")
            if time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"{name} not ready after {timeout} s; log: {self.log.name}")
            try:
                if urllib.request.urlopen(self.url + "/health", timeout=2).status == 200:
                    break
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(1)
        self.startup_s = time.perf_counter() - t0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # (vLLM's engine children share its group)
        except ProcessLookupError:
            pass
        self.log.close()


def embed_all(url: str, model: str, inputs: list[list[int]]) -> tuple[float, list[np.ndarray]]:
    """Every input as its own /v1/embeddings request, all at once: (seconds, vectors in order)."""
    def one(ids):
        body = json.dumps({"model": model, "input": [ids], "encoding_format": "float"}).encode()
        req = urllib.request.Request(url + "/v1/embeddings", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=3600) as r:
            return np.asarray(json.load(r)["data"][0]["embedding"], np.float32)

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(inputs)) as pool:
        vectors = list(pool.map(one, inputs))
    return time.perf_counter() - t0, vectors


WORDS = ("the a of to in is was for on that with as by at from it this be are or an which one all were but "
         "cat dog house river city market paper music water light night morning garden window story money "
         "people school family market engine model server token vector query answer reason number letter").split()


def words(rng, n: int) -> str:
    """`n` random words (a text neither server has seen)."""
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n))


def rerank_all(url: str, model: str, requests: list[tuple[str, list[str]]],
               instruction: str | None = None) -> tuple[float, list[list[float]], int]:
    """Every (query, documents) as its own /rerank request, all at once: (seconds, each request's scores in document
    order, the prompt tokens the server counted)."""
    def one(item):
        query, docs = item
        extra = {} if instruction is None else {"instruction": instruction}
        body = json.dumps({"model": model, "query": query, "documents": docs, **extra}).encode()
        req = urllib.request.Request(url + "/rerank", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=3600) as r:
            answer = json.load(r)
        scores = [0.0] * len(docs)
        for x in answer["results"]:
            scores[x["index"]] = float(x["relevance_score"])
        return scores, int(answer["usage"]["prompt_tokens"])

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(one, requests))
    return time.perf_counter() - t0, [s for s, _ in answers], sum(n for _, n in answers)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="jaxcb's --model")
    ap.add_argument("--config", default=None, help="jaxcb's --config (default: its own)")
    ap.add_argument("--jaxcb-args", default="", help="more of jaxcb serve's flags, e.g. '--weights int8 --activations int8'")
    ap.add_argument("--inputs", type=int, default=256)
    ap.add_argument("--min-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--vllm-model", default="/tmp/peers/smollm2-hf")
    ap.add_argument("--vllm-dtype", default="float32")
    ap.add_argument("--task", choices=("embed", "rerank"), default="embed")
    ap.add_argument("--documents", type=int, default=8, help="--task rerank: documents per query")
    ap.add_argument("--score-template", default=None, metavar="FILE",
                    help="--task rerank: a score template given to both servers (--chat-template), and "
                         "--instruction sent with every request")
    ap.add_argument("--instruction", default=None)
    a = ap.parse_args(argv)
    if a.task == "rerank":
        return rerank_main(a)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # (a killed run still stops its servers)

    rng = np.random.default_rng(a.seed)
    lengths = rng.integers(a.min_tokens, a.max_tokens + 1, a.inputs)

    def fresh():  # inputs no server has seen (nothing of them in a prefix cache), the same lengths every trial
        return [rng.integers(100, 40000, int(n)).tolist() for n in lengths]

    tokens = int(lengths.sum())
    servers = {}
    try:
        servers = start_servers(a, ["--convert", "embed"], [])
        for s in servers.values():  # (a first call each: nothing of either's start-up in the trials)
            embed_all(s.url, "bench", fresh()[:4])
        results = {name: [] for name in servers}
        vectors = {}
        for trial in range(a.trials):
            inputs = fresh()  # (each trial's own, the same for both servers)
            for name, s in servers.items():
                seconds, vectors[name] = embed_all(s.url, "bench", inputs)
                results[name].append(seconds)
                print(f"trial {trial + 1} {name}: {len(inputs) / seconds:.1f} inputs/s, "
                      f"{tokens / seconds:.0f} tokens/s "
                      f"({seconds:.2f} s)", flush=True)
        out = {"cpu": cpu_name(), "inputs": a.inputs, "prompt_tokens": tokens, "jaxcb_args": a.jaxcb_args,
               "vllm_dtype": a.vllm_dtype if a.vllm_python else None}
        for name, times in results.items():
            best = min(times)
            out[name] = {"seconds": [round(t, 2) for t in times], "inputs_per_s": round(a.inputs / best, 1),
                         "tokens_per_s": round(tokens / best), "startup_s": round(servers[name].startup_s, 1)}
        if "vllm" in vectors:
            cos = [float(np.dot(x, y) / (np.linalg.norm(x) * np.linalg.norm(y)))
                   for x, y in zip(vectors["jaxcb"], vectors["vllm"])]
            out["cosine_min"], out["cosine_mean"] = round(min(cos), 6), round(float(np.mean(cos)), 6)
            out["jaxcb_over_vllm"] = round(min(results["vllm"]) / min(results["jaxcb"]), 2)
        print(json.dumps(out))
    finally:
        for s in servers.values():
            s.stop()


def start_servers(a, vllm_task: list[str], jaxcb_task: list[str]) -> dict:
    """jaxcb's server and (with --vllm-python) vLLM's, each told its task's flags."""
    servers = {}
    port = free_port()
    cmd = [sys.executable, "-m", "jaxcb", "serve", "--model", a.model, "--port", str(free_port()),
           "--http-port", str(port), "--served-model-name", "bench"] + (["--config", a.config] if a.config else [])
    servers["jaxcb"] = Server("jaxcb", cmd + jaxcb_task + a.jaxcb_args.split(), port)
    if a.vllm_python:
        port = free_port()
        work = tempfile.mkdtemp(prefix="bench-embeddings-vllm-cache-")
        cmd = [a.vllm_python, "-c", VLLM_SHIM, "serve", a.vllm_model, "--host", "127.0.0.1", "--port", str(port),
               "--dtype", a.vllm_dtype, "--runner", "pooling", "--served-model-name", "bench",
               "--max-model-len", "2048", "--disable-uvicorn-access-log"] + vllm_task
        servers["vllm"] = Server("vllm", cmd, port, env=dict(
            VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND="0-1",
            VLLM_CACHE_ROOT=os.path.join(work, "cache"), TORCHINDUCTOR_CACHE_DIR=os.path.join(work, "inductor"),
            VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"))
    return servers


def rerank_main(a) -> None:
    rng = np.random.default_rng(a.seed)
    query_words = rng.integers(4, 16, a.inputs)
    doc_words = rng.integers(a.min_tokens // 2, a.max_tokens // 2 + 1, (a.inputs, a.documents))

    def fresh():  # texts no server has seen, the same numbers of words every trial
        return [(words(rng, int(q)), [words(rng, int(n)) for n in docs]) for q, docs in zip(query_words, doc_words)]

    pairs = a.inputs * a.documents
    servers = {}
    try:
        template = ["--chat-template", a.score_template] if a.score_template else []
        servers = start_servers(a, ["--convert", "classify", "--hf-overrides", json.dumps(
            {"classifier_from_token": ["no", "yes"], "method": "from_2_way_softmax"})] + template,
            ["--classifier-from-tokens", "no,yes"] + template)
        for s in servers.values():
            rerank_all(s.url, "bench", fresh()[:2], a.instruction)
        results, scores, tokens = {name: [] for name in servers}, {}, 0
        for trial in range(a.trials):
            requests = fresh()
            for name, s in servers.items():
                seconds, scores[name], counted = rerank_all(s.url, "bench", requests, a.instruction)
                tokens = counted if name == "jaxcb" else tokens
                results[name].append(seconds)
                print(f"trial {trial + 1} {name}: {pairs / seconds:.1f} pairs/s, {counted / seconds:.0f} tokens/s as "
                      f"it counts them ({counted} tokens, {seconds:.2f} s)", flush=True)
        out = {"cpu": cpu_name(), "task": "rerank", "requests": a.inputs, "documents": a.documents, "pairs": pairs,
               "prompt_tokens": tokens, "jaxcb_args": a.jaxcb_args, "vllm_dtype": a.vllm_dtype if a.vllm_python else None}
        for name, times in results.items():
            best = min(times)
            out[name] = {"seconds": [round(t, 2) for t in times], "pairs_per_s": round(pairs / best, 1),
                         "tokens_per_s": round(tokens / best), "startup_s": round(servers[name].startup_s, 1)}
        if "vllm" in scores:
            diff = [abs(x - y) for xs, ys in zip(scores["jaxcb"], scores["vllm"]) for x, y in zip(xs, ys)]
            out["score_diff_max"], out["score_diff_mean"] = float(f"{max(diff):.2e}"), float(f"{np.mean(diff):.2e}")
            same = sum(np.argsort(-np.asarray(x)).tolist() == np.argsort(-np.asarray(y)).tolist()
                       for x, y in zip(scores["jaxcb"], scores["vllm"]))
            out["same_order"] = f"{same}/{a.inputs}"
            out["jaxcb_over_vllm"] = round(min(results["vllm"]) / min(results["jaxcb"]), 2)
        print(json.dumps(out))
    finally:
        for s in servers.values():
            s.stop()


if __name__ == "__main__":
    main()
