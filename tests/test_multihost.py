"""Multi-host serving (jaxcb.multihost) with two local processes of two forced host devices each,
joined by jax.distributed (gloo collectives): the leader serves and broadcasts every step, the
follower mirrors it."""

from __future__ import annotations

import concurrent.futures
import time

import numpy as np

from jaxcb.engine_config import load_config
from jaxcb.llm import LLM
from jaxcb.request import SamplingParams
from serve.client import Client
from server_util import ServerProcess, free_port


class Cluster:
    """Leader and follower, each `jaxcb serve` with two forced host devices; the follower opens no port."""

    def __init__(self, model: str, config: str):
        port, coordinator = free_port(), free_port()
        env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
        args = ("--coordinator", f"127.0.0.1:{coordinator}", "--num-processes", "2", "--compile-cache", "off")
        self.follower = ServerProcess(model, config, *args, "--process-id", "1", env=env, port=port)
        self.leader = ServerProcess(model, config, *args, "--process-id", "0", env=env, port=port)

    def stop(self):
        for p in (self.leader, self.follower):
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()


def test_two_processes_give_the_single_device_tokens_and_stop_together(tiny_gguf_path, tiny_model, config_path,
                                                                       tmp_path):
    cluster = Cluster(tiny_gguf_path, config_path)
    try:
        cluster.leader.wait_serving()
        rng = np.random.default_rng(7)
        prompts = [rng.integers(3, 128, int(n)).tolist() for n in rng.integers(2, 60, 8)]
        with Client(cluster.leader.target) as c:
            warm = c.server_info().compilations
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                results = list(pool.map(
                    lambda p: c.complete(token_ids=p, max_tokens=12, ignore_eos=True, timeout=120), prompts))
            info = c.server_info()
        assert info.compilations == warm  # nothing compiled after warm-up, broadcasts included
        assert info.tensor_parallel == 4 and info.pages_free == info.pages_total
        cfg, params, tok, eos = tiny_model
        offline = LLM.from_params(cfg, params, tok, config=load_config(config_path), eos_ids=eos)
        expected = offline.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
        assert [r.token_ids for r in results] == [o.token_ids for o in expected]
        assert cluster.leader.stop() == 0, cluster.leader.output()
        assert cluster.follower.proc.wait(60) == 0, cluster.follower.output()
        assert "stopped by the leader" in cluster.follower.output()
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
