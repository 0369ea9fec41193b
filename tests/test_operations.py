"""Operator tools: memory plan, persistent compile cache, length recording and bucket planning."""

import json
import math
import os

import pytest

from jaxcb.cli import main as cli
from jaxcb.device import compile_cache
from jaxcb.host import memory_plan
from jaxcb.host.engine_config import load_config, make_config
from jaxcb.host.request import SamplingParams
from jaxcb.llm import LLM

SMOLLM2 = dict(num_layers=30, num_kv_heads=3, head_dim=64, hidden_size=576, intermediate_size=1536,
               vocab_size=49152, dtype_bytes=2, page_size=16, max_batch=32, max_prefill_tokens=512)


def test_memory_plan_fits_pages_after_weights_and_the_step():
    plan = memory_plan.plan(budget_bytes=80 * 2**30, fraction=0.9, weight_bytes=270_000_000, max_context=2048,
                            **SMOLLM2)
    assert plan.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2  # 23 KiB a token
    assert plan.weight_bytes + plan.reserve_bytes + plan.kv_bytes <= 0.9 * 80 * 2**30
    assert plan.weight_bytes + plan.reserve_bytes + plan.kv_bytes + plan.page_bytes > 0.9 * 80 * 2**30
    assert plan.max_batch_at(2048) == (plan.num_pages - 1) // 128
    assert "largest batch at context 2048" in plan.describe()


def test_memory_plan_refuses_what_cannot_hold_one_request():
    with pytest.raises(ValueError) as e:
        memory_plan.plan(budget_bytes=300 * 2**20, fraction=0.9, weight_bytes=270_000_000, max_context=2048,
                         **SMOLLM2)
    message = str(e.value)
    assert "300.0 MiB" in message and "weights (257.5 MiB)" in message and "one request of 2048 tokens" in message
    with pytest.raises(ValueError, match="cache.num_pages"):
        memory_plan.plan(budget_bytes=2**30, fraction=0.9, weight_bytes=0, max_context=2048, num_pages=10**6,
                         **SMOLLM2)
    assert memory_plan.parse_bytes("80GiB") == 80 * 2**30 and memory_plan.parse_bytes("1.5 GB") == 1_500_000_000
    with pytest.raises(ValueError, match="not a size"):
        memory_plan.parse_bytes("lots")


def test_engine_refuses_a_config_before_allocating(tiny_model):
    cfg, params, tok, eos = tiny_model
    with pytest.raises(ValueError, match="memory: .* needed"):
        LLM.from_params(cfg, params, tok, config=_config_with_memory(1_000_000), eos_ids=eos)
    auto = LLM.from_params(cfg, params, tok, config=_config_with_memory(64 * 2**20, num_pages=0), eos_ids=eos)
    assert auto.engine.pool.num_pages > 1000  # "auto": as many as fit in 64 MiB


def _config_with_memory(memory, num_pages=64):
    import dataclasses

    c = make_config(num_pages=max(num_pages, 2), max_context=256, decode_batch=(1, 2), prefill_tokens=(16, 32))
    return dataclasses.replace(c, num_pages=num_pages, memory_bytes=memory)


def test_plan_command(tiny_gguf_path, capsys):
    assert cli(["plan", "--model", tiny_gguf_path, "--memory", "1GiB", "--max-context", "256"]) == 0
    out = capsys.readouterr().out
    assert "KV pages" in out and "largest batch at context 256" in out
    # the host's largest piece while loading: the tiny model's largest weight, built whole (no stack is large)
    from jaxcb.llm import read_model_config

    shapes = read_model_config(tiny_gguf_path).weight_shapes()
    name = max(shapes, key=lambda n: math.prod(shapes[n]))
    assert (f"host memory while loading: about {memory_plan.fmt_bytes(4 * math.prod(shapes[name]))} beside the file's "
            f"pages (the largest piece built at once, in float32: {name})") in out
    assert cli(["plan", "--model", tiny_gguf_path, "--memory", "1KiB"]) == 2
    assert "memory: 1.0 KiB" in capsys.readouterr().err
    # --rope-scaling: the model planned with it (a bad one refused naming the setting)
    yarn = '{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}'
    assert cli(["plan", "--model", tiny_gguf_path, "--memory", "1GiB", "--rope-scaling", yarn]) == 0
    assert cli(["plan", "--model", tiny_gguf_path, "--memory", "1GiB", "--rope-scaling", "{"]) == 2
    assert "model.rope_scaling: not JSON" in capsys.readouterr().err


def test_the_largest_piece_a_load_builds_on_the_host_is_a_layer_of_a_large_stack():
    """A 70B-shaped model: its MLP stacks (75 GB each in float32) are built a layer at a time, so the largest piece on
    the host is the embedding (4.2 GB); a DeepSeek-V3-shaped mixture: a layer of one expert matrix stack (256 experts
    of 7,168 x 2,048: 15 GB), not the stack (870 GB)."""
    from jaxcb.model.config import tiny_config
    from jaxcb.model.llama import by_layer, largest_host_piece

    llama70 = tiny_config(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                          num_kv_heads=8, head_dim=128)
    assert by_layer(llama70.weight_shapes()["w_gate"]) and not by_layer((30, 576, 1536))  # (SmolLM2's: whole)
    assert largest_host_piece(llama70) == ("embed", 4 * 128256 * 8192, False)
    moe = tiny_config(vocab_size=129280, hidden_size=7168, intermediate_size=2048, num_layers=58, num_heads=8,
                      num_kv_heads=8, head_dim=128, num_experts=256, experts_per_token=8)
    assert largest_host_piece(moe) == ("experts_gate", 4 * 256 * 7168 * 2048, True)


def test_compile_cache_dir_not_writable_warns_and_runs_without(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert compile_cache.enable(str(blocker / "cache")) is None
    assert "not writable" in capsys.readouterr().err
    assert compile_cache.enable("off") is None
    os.environ["JAXCB_COMPILE_CACHE"], before = str(tmp_path / "c"), os.environ.get("JAXCB_COMPILE_CACHE")
    try:
        assert compile_cache.default_dir() == str(tmp_path / "c")
    finally:
        os.environ["JAXCB_COMPILE_CACHE"] = before


def test_recorded_lengths_plan_buckets(make_llm, tmp_path, capsys):
    llm = make_llm()
    log = tmp_path / "lengths.jsonl"
    llm.engine.record_lengths(str(log))
    llm.generate([[5] * n for n in (3, 20, 40, 41, 90)], SamplingParams(max_tokens=5, ignore_eos=True))
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert sorted(x["prompt"] for x in lines) == [3, 20, 40, 41, 90]
    assert all(x["context"] == x["prompt"] + 5 for x in lines)

    config = tmp_path / "c.toml"
    config.write_text("[cache]\npage_size = 16\nnum_pages = 64\n[scheduler]\nmax_context = 256\n"
                      "[buckets]\ndecode_batch = [1, 2]\npages_per_seq = [16]\nprefill_tokens = [64]\n")
    fragment = tmp_path / "buckets.toml"
    assert cli(["buckets", "--lengths", str(log), "--max-buckets", "3", "--config", str(config),
                "--out", str(fragment)]) == 0
    out = capsys.readouterr().out
    assert "expected chunk padding" in out and "the config's [64]" in out and "powers of two" in out
    text = config.read_text().split("[buckets]")[0] + fragment.read_text()
    config.write_text(text)
    planned = load_config(str(config)).buckets
    assert planned.prefill_tokens[-1] == 64 and len(planned.prefill_tokens) <= 3
    assert planned.pages_per_seq[-1] == 16
    log.write_text("not json\n")
    assert cli(["buckets", "--lengths", str(log), "--max-buckets", "3"]) == 2
    assert "line 1" in capsys.readouterr().err


def test_the_default_config_is_the_source_trees():
    """load_config() with no path reads configs/default.toml of this tree (a path that went stale when
    a module moved would fall back to the built-in defaults without a word)."""
    from jaxcb.host.engine_config import DEFAULT_CONFIG, load_config

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert DEFAULT_CONFIG == os.path.join(root, "configs", "default.toml")
    assert load_config() == load_config(os.path.join(root, "configs", "default.toml"))
