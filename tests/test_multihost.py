"""Multi-host serving (jaxcb.device.multihost) with two local processes of two forced host devices each,
joined by jax.distributed (gloo collectives): the leader serves and broadcasts every step, the
follower mirrors it."""

from __future__ import annotations

import concurrent.futures
import itertools
import time

import numpy as np
import pytest

from jaxcb.host.engine_config import load_config
from jaxcb.host.request import SamplingParams
from jaxcb.llm import LLM
from serve.client import Client, _result, build_request
from tests.server_util import SMALL_CONFIG, ServerProcess, free_port


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    """The small server config with one bucket of each kind: both processes compile every shape (and
    its broadcast) at warm-up, and fewer shapes keep these tests cheap; every prompt and output here
    fits (at most 80 + 30 tokens: 16 pages of 16, prefill chunks of 64)."""
    path = tmp_path_factory.mktemp("multihost") / "one-bucket.toml"
    path.write_text(SMALL_CONFIG.replace("decode_batch = [1, 2, 4, 8]", "decode_batch = [8]")
                    .replace("pages_per_seq = [4, 16]", "pages_per_seq = [16]")
                    .replace("prefill_tokens = [32, 64]", "prefill_tokens = [64]"))
    return str(path)


class Cluster:
    """Leader and follower, each `jaxcb serve` with two forced host devices; the follower opens no port."""

    def __init__(self, model: str, config: str, leader_args=(), follower_args=()):
        port, coordinator = free_port(), free_port()
        env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2",
               "JAXCB_HUGE_PAGES": "1"}  # (a tiny model's pool: milliseconds) to see the followers' taken
        args = ("--coordinator", f"127.0.0.1:{coordinator}", "--num-processes", "2", "--compile-cache", "off")
        self.follower = ServerProcess(model, config, *args, "--process-id", "1", *follower_args, env=env, port=port)
        self.leader = ServerProcess(model, config, *args, "--process-id", "0", *leader_args, env=env, port=port)

    def stop(self):
        for p in (self.leader, self.follower):
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()


def test_two_processes_give_the_single_device_tokens_with_lora_adapters_and_stop_together(
        tiny_gguf_path, tiny_model, config_path, tmp_path):
    """The base model and LoRA adapters in one batch: one given to the leader at start (the follower is
    not given its files), one loaded while serving, two slots for three models (swaps): every request's
    tokens are the one-process engine's, and nothing compiles after warm-up."""
    import dataclasses

    from jaxcb.host.lora import LoraConfig
    from serve.proto import jaxcb_pb2
    from tests.lora_util import write_adapter

    cfg, params, tok, eos = tiny_model
    paths = {"all4": str(tmp_path / "all4"), "mlp": str(tmp_path / "mlp")}
    write_adapter(paths["all4"], cfg, rank=4, seed=1)
    write_adapter(paths["mlp"], cfg, rank=8, targets=("w_gate", "w_up", "w_down"), seed=3)
    slots = ("--max-loras", "2", "--max-lora-rank", "8")
    cluster = Cluster(tiny_gguf_path, config_path, ("--lora", f"all4={paths['all4']}", *slots), slots)
    try:
        cluster.leader.wait_serving()
        rng = np.random.default_rng(7)
        prompts = [rng.integers(3, 128, int(n)).tolist() for n in rng.integers(2, 60, 9)]
        names = ["", "all4", "mlp"] * 3
        with Client(cluster.leader.target) as c:
            warm = c.server_info().compilations
            c.stub.LoadLoraAdapter(jaxcb_pb2.LoadLoraAdapterRequest(lora_name="mlp", lora_path=paths["mlp"]))
            with concurrent.futures.ThreadPoolExecutor(9) as pool:
                results = list(pool.map(lambda p, name: c.complete(token_ids=p, max_tokens=12, ignore_eos=True,
                                                                   lora=name, timeout=120), prompts, names))
            embedded = c.embed(prompts[:2])  # (the pooled hidden states come back from the leader's own copy)
            info = c.server_info()
        assert info.compilations == warm  # nothing compiled after warm-up, broadcasts and slot fills included
        assert info.tensor_parallel == 4 and info.pages_free == info.pages_total
        offline = LLM.from_params(cfg, params, tok, eos_ids=eos, config=load_config(config_path).replace(
            lora=LoraConfig(max_loras=2, max_rank=8)))
        for name, path in paths.items():
            offline.engine.load_lora(name, path)
        greedy = SamplingParams(max_tokens=12, ignore_eos=True)
        expected = [offline.generate([p], dataclasses.replace(greedy, lora=name))[0] for p, name in zip(prompts, names)]
        assert [r.token_ids for r in results] == [o.token_ids for o in expected]
        for got, want in zip(embedded.embeddings, offline.embed(prompts[:2])):
            assert np.abs(np.asarray(got.values) - want).max() < 1e-5
        base = offline.generate(prompts[1:3], greedy)  # (the adapters change the tokens)
        assert all(r.token_ids != o.token_ids for r, o in zip(results[1:3], base))
        # Stopped as Kubernetes stops a LeaderWorkerSet's group (SIGTERM to every pod at once) with a stream in
        # flight: the follower keeps following while the leader drains, so the stream ends whole.
        with Client(cluster.leader.target) as c:
            stream = c.stream(build_request(token_ids=prompts[0], max_tokens=30, ignore_eos=True), 120)
            first = next(stream)
            cluster.follower.proc.terminate()
            cluster.leader.proc.terminate()
            drained = _result(itertools.chain([first], stream))
        assert len(drained.token_ids) == 30 and drained.finish_reason == "length"
        assert cluster.leader.stop() == 0, cluster.leader.output()
        assert cluster.follower.proc.wait(60) == 0, cluster.follower.output()
        assert "stopped by the leader" in cluster.follower.output()
        assert "of the KV pages in 2 MiB pages" in cluster.follower.output()  # the leader's warm-up passed on
    finally:
        cluster.stop()


def test_a_dead_follower_makes_the_leader_exit_non_zero(tiny_gguf_path, config_path, tmp_path):
    cluster = Cluster(tiny_gguf_path, config_path)
    try:
        cluster.leader.wait_serving()
        cluster.follower.proc.kill()
        t0 = time.monotonic()
        code = cluster.leader.proc.wait(60)  # found by the next broadcast: a ping within a second
        assert code != 0, cluster.leader.output()
        assert time.monotonic() - t0 < 30
        assert "the engine died" in cluster.leader.output()
    finally:
        cluster.stop()


def _windowed_model_dir(path, tokenizer) -> str:
    """A tiny Gemma 3 checkpoint in the Hugging Face layout (sliding-window layers, window 8; written by
    tools/make_tiny_hf.py), with a tokenizer beside it for the server."""
    import os
    import shutil

    src = os.path.join(os.path.dirname(__file__), "golden", "tiny_hf", "gemma3")
    shutil.copytree(src, path)
    tokenizer.save(str(path))
    return str(path)


@pytest.mark.parametrize("kind", ["int8", "windowed"])
def test_two_processes_run_the_single_process_engine_with_int8_weights_windows_and_a_draft(
        kind, tiny_gguf_path, tiny_model, config_path, tmp_path):
    """Followers build the leader's engine: with --weights int8 (quantized shards everywhere) and with a
    sliding-window model (the broadcast carries the window pages), both speculating with a draft model
    (the model's first layer, or for the windowed one all of them: its steps go out too, marked for the
    draft), the tokens are those of the one-process engine without speculation, and proposals were
    accepted."""
    cfg, params, tok, eos = tiny_model
    config = load_config(config_path)
    drafting = tmp_path / "draft.toml"  # (the windowed model's first layer is a sliding one: all its layers)
    drafting.write_text(open(config_path).read() + "[speculative]\nmethod = \"draft\"\ndraft_layers = "
                        f"{1 if kind == 'int8' else 0}\nnum_tokens = 3\nadaptive = false\n")
    if kind == "int8":
        model, extra = tiny_gguf_path, ("--weights", "int8")
        offline = LLM(tiny_gguf_path, config=config.replace(weights="int8"))
    else:
        model, extra = _windowed_model_dir(tmp_path / "windowed", tok), ()
        offline = LLM(model, config=config)
    cluster = Cluster(model, str(drafting), extra, extra)
    try:
        cluster.leader.wait_serving()
        rng = np.random.default_rng(8)
        prompts = [rng.integers(3, 120, int(n)).tolist() for n in rng.integers(2, 80, 6)]  # past window 8
        with Client(cluster.leader.target) as c:
            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                results = list(pool.map(
                    lambda p: c.complete(token_ids=p, max_tokens=30, ignore_eos=True, timeout=120), prompts))
            info = c.server_info()
        assert info.speculative_method.startswith("draft") and info.speculative_acceptance_rate > 0
        expected = offline.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))
        assert [r.token_ids for r in results] == [o.token_ids for o in expected]
        assert cluster.leader.stop() == 0, cluster.leader.output()
        assert cluster.follower.proc.wait(60) == 0, cluster.follower.output()
    finally:
        cluster.stop()


def test_processes_that_would_not_run_one_engine_refuse_to_start(tiny_gguf_path, config_path):
    """A follower started with other weights than the leader's: both exit non-zero, naming what differs."""
    cluster = Cluster(tiny_gguf_path, config_path, follower_args=("--weights", "int8"))
    try:
        assert cluster.leader.proc.wait(180) != 0
        assert cluster.follower.proc.wait(60) != 0
        out = cluster.leader.output()
        assert "would not run one engine" in out and "process 1 weights" in out, out
    finally:
        cluster.stop()


def test_two_processes_read_a_checkpoint_onto_their_shards_a_layer_at_a_time():
    """Across two processes (two devices each) every stack of the tiny DeepSeek-V3 is built on the mesh a layer at a
    time, each process making its own shards from its host's read (tests/multihost_load_check.py): every shard each
    process holds is its slice of the weight as read whole."""
    import json
    import os
    import subprocess
    import sys

    coordinator = f"127.0.0.1:{free_port()}"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = [subprocess.Popen([sys.executable, "-m", "tests.multihost_load_check", coordinator, str(i)], cwd=root,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    results = []
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(r["process"] for r in results) == [0, 1]
    for r in results:
        assert r["devices"] == 4 and r["weights"] > 20 and r["local_shards"] == 2 * r["weights"], r
        assert r["differ"] == [] and {"wq_b", "experts_gate", "w_uk"} <= set(r["by_layer"]), r


def test_new_weights_reach_every_process_of_the_cluster(tiny_gguf_path, tiny_model, config_path, tmp_path):
    """POST /update_weights_from_disk on the leader: every process reads its own shards of the checkpoint (the path
    broadcast, compiled at warm-up), and the cluster's tokens are then those of one process built with the new
    weights; nothing compiles; an update the leader refuses (another model) leaves the cluster as it was."""
    import httpx

    from jaxcb.llm import load_model
    from tests.tiny_gguf import tiny_model_config, write_tiny_gguf

    other, deeper = str(tmp_path / "other.gguf"), str(tmp_path / "deeper.gguf")
    write_tiny_gguf(other, seed=1)
    write_tiny_gguf(deeper, tiny_model_config(num_layers=tiny_model[0].num_layers + 1))
    http = free_port()
    cluster = Cluster(tiny_gguf_path, config_path, ("--http-port", str(http), "--dev-routes"))
    try:
        cluster.leader.wait_serving()
        rng = np.random.default_rng(5)
        prompts = [rng.integers(3, 128, int(n)).tolist() for n in rng.integers(2, 60, 4)]

        def complete(c):
            return [c.complete(token_ids=p, max_tokens=12, ignore_eos=True, timeout=120).token_ids for p in prompts]

        def offline(path):
            cfg, params, tok, eos = load_model(path)
            llm = LLM.from_params(cfg, params, tok, eos_ids=eos, config=load_config(config_path))
            return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))]

        with Client(cluster.leader.target) as c:
            warm = c.server_info().compilations
            before = complete(c)
            r = httpx.post(f"http://127.0.0.1:{http}/update_weights_from_disk", timeout=120,
                           json={"model_path": other, "weight_version": "step-1"})
            assert r.status_code == 200, r.text
            after = complete(c)
            r = httpx.post(f"http://127.0.0.1:{http}/update_weights_from_disk", json={"model_path": deeper}, timeout=120)
            assert r.status_code == 400 and "num_layers" in r.json()["error"]["message"], r.text
            assert complete(c) == after
            info = c.server_info()
        assert after == offline(other) and before == offline(tiny_gguf_path) and after != before
        assert info.compilations == warm
        assert cluster.leader.stop() == 0, cluster.leader.output()
        assert cluster.follower.proc.wait(60) == 0, cluster.follower.output()
    finally:
        cluster.stop()
