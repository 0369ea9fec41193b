"""Tensor parallelism (jaxcb.device.parallel): the sharded step gives the single-device tokens.

Meshes need forced host devices, which must be set before JAX starts: the engines run in a
subprocess (tests/tp_check.py)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxcb.device.parallel import check_tensor_parallel
from jaxcb.host.engine_config import load_config, make_config
from jaxcb.model.config import tiny_config

HERE = os.path.dirname(os.path.abspath(__file__))


def test_experts_split_over_devices_are_partitioned_without_gathering_them():
    """A mixture of experts' layer with each expert's columns on 2 devices: both ways of running it (the GPU's
    and TPU's, grouped through ragged_dot; the CPU's loop) give the single-device output, and XLA's SPMD
    partitioner joins the devices' parts with one all-reduce (the down projection's sums), gathering no
    expert's matrices (tests/moe_tp_check.py, in a subprocess: forced host devices)."""
    proc = subprocess.run([sys.executable, "-m", "tests.moe_tp_check"], capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(HERE))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for way, run in out.items():
        assert run["max_diff"] <= 1e-5 * run["scale"], (way, run)
        assert run["collectives"] == ["all-reduce"], (way, run["collectives"])


def test_meshes_give_the_single_device_tokens(tmp_path):
    """Tiny models over 8 forced host devices: TP 2/4/8 (KV heads replicated at TP 4 of model a and
    TP 4/8 of model b), the Pallas kernels in interpret mode under shard_map, TP 2 x DP 2;
    quantized weights split with their scales (int4 at TP 2; model b with int8 weights and int8 KV pages
    throughout, KV heads replicated at TP 8, the Pallas kernels at TP 4); a tiny Gemma 3 (two page groups) at TP 2
    and DP 2; a tiny Qwen2-MoE (a mixture of experts and a shared expert; float and int8) and a tiny OLMo 2 (q and k normed over
    heads split over the devices) and a tiny gpt-oss (attention sinks split with their heads; plain JAX and the Pallas
    kernels) and a tiny DeepSeek-V3 (a dense layer, then experts' layers, each kind's matrices split; latent
    attention: its one KV head copied onto each device) at TP 2; n-gram speculation at TP 2 x DP 2; and two LoRA adapters beside the base model at TP 2,
    TP 2 x DP 2 and TP 4 (KV heads, and the adapters' k/v columns, replicated); speculative decoding with a
    draft model split over the mesh at TP 2; engines built from the file at TP 2 (int4) and TP 4, their weights
    placed on the mesh as they are read (every stack a layer at a time), and checkpoints read straight onto meshes
    of 2 and 4 (a Hugging Face one whole or a layer at a time alike). Every run's pooled vectors, and the output
    head's rows a from-token classifier reads (gathered off the mesh), are the single device's. Models a and g then
    take new weights while serving (a file's; a state dict's by Hugging Face names) in every run, and answer the same
    requests with the single device's new tokens, compiling nothing."""
    proc = subprocess.run([sys.executable, "-m", "tests.tp_check", str(tmp_path)], capture_output=True, text=True,
                          timeout=1500, cwd=os.path.dirname(HERE))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # [L, 2, K, P, S, D] per device: one device holds both KV heads; TP 2 one each; TP 4 over 2 KV heads
    # holds one copy per device (replicated), as does TP 8 over model b's 2.
    assert [s[2:4] for s in out["a-tp1"]["kv_shards"][0]] == [[2, 16]]
    assert [s[2:4] for s in out["a-tp2"]["kv_shards"][0]] == [[1, 16]] * 2
    assert [s[2:4] for s in out["a-tp4"]["kv_shards"][0]] == [[1, 16]] * 4
    assert [s[2:4] for s in out["b-tp8-int8"]["kv_shards"][0]] == [[1, 16]] * 8
    # Quantized matrices split like the floats, scales with them: int4's packed [L, in/2, out] by
    # columns at TP 2; int8's [L, in, out] over 4 devices.
    assert out["a-tp2-int4"]["wq_shards"] == [[2, 32, 32]] * 2
    assert out["b-tp8-int8"]["wq_shards"] == [[2, 128, 16]] * 8
    # int8 KV pages (values and a 4-byte scale per slot) split on the KV heads like float ones, one
    # replicated head a device at TP 8 over 2 KV heads; the Pallas kernels read them under shard_map.
    assert out["b-tp8-int8"]["kv_dtype"] == "int8"
    assert [s[2:] for s in out["b-tp8-int8"]["kv_shards"][0]] == [[1, 16, 16, 20]] * 8
    assert out["a-tp1"]["preemptions"] > 0  # a pool tight enough to preempt under the meshes too
    assert out["a-tp2-dp2-spec"]["speculative_accepted"] > 0  # speculation over a mesh and replicas
    # LoRA slots split with their targets: wq's B [L, S*R, out] by columns at TP 2.
    assert out["a-tp2-lora"]["lora_b_wq_shards"] == [[2, 8, 32]] * 2
    assert out["a-tp1-lora"]["tokens"] != out["a-tp1"]["tokens"]  # the adapters change the tokens
    # A draft model (the target's first layer) split over the target's mesh: wq [1, in, out] by columns.
    for name in ("a-tp2-draft", "a-tp2-direct-draft"):  # (the target's first layer; a draft model's, read onto the mesh)
        assert out[name]["draft_wq_shards"] == [[1, 64, 32]] * 2 and out[name]["speculative_accepted"] > 0, name
    # Read straight onto the mesh: every weight of the tiny DeepSeek-V3 (a Hugging Face checkpoint) at TP 2, and of
    # model a converted to int8 (orbax) at TP 4 (its K and V whole on each device), in its split as load_model returns it.
    placed, converted = out.pop("placed"), out.pop("placed_converted")
    assert placed["count"] > 20 and placed["devices"] == [2] and placed["elsewhere"] == [], placed
    assert converted["copied"] and converted["devices"] == [4] and converted["elsewhere"] == [], converted
    assert placed["by_layer_differ"] == [] and converted["by_layer_differ"] == []  # (built a layer at a time: the same)
    for name, run in out.items():
        weights = name.split("-")[-1] if name.endswith(("-int4", "-int8", "-lora")) else None
        reference = out[name[0] + "-tp1" + (f"-{weights}" if weights else "")]
        assert run["tokens"] == reference["tokens"], name  # a structured-output row included (models a and b)
        pooled, single = np.asarray(run["embeddings"]), np.asarray(reference["embeddings"])  # (last, mean, last)
        assert np.abs(pooled - single).max() < 1e-4 * np.abs(single).max(), name
        rows, single = np.asarray(run["head_rows"]), np.asarray(reference["head_rows"])  # (gathered off the mesh)
        assert rows.shape == single.shape and np.abs(rows - single).max() <= 1e-6 * np.abs(single).max(), name
        assert run["compilations_after_warmup"] == 0, name  # (new weights taken while serving, where given, too)
        assert run["updated_tokens"] == reference["updated_tokens"], name
        assert (run["updated_tokens"] is not None) == (name[0] in "ag"), name
    for name in ("a-tp1", "g-tp1", "a-tp1-int4", "a-tp1-lora"):  # (the new weights change the tokens)
        assert out[name]["updated_tokens"] != out[name]["tokens"], name
    # Replicas on disjoint devices, both used, every routed token accounted for at the end.
    assert out["g-dp2"]["devices"] == [[0], [1]]
    assert out["a-tp2-dp2"]["devices"] == [[0, 1], [2, 3]]
    assert [s[2:4] for s in out["g-tp2"]["kv_shards"][0]] == [[1, 16]] * 2  # Gemma's full-layer group, split
    for name in ("g-dp2", "a-tp2-dp2"):
        assert min(out[name]["routed"]) > 0 and sum(out[name]["routed"]) == 6 + 3 + 6, name  # (the prompts, 3 embeddings, the prompts again)
        assert out[name]["load_left"] == [0, 0], name


@pytest.mark.parametrize("tensor, message", [
    (3, "parallel.tensor: 3 devices do not divide the model's 4 query heads"),
    (6, "parallel.tensor: 6 devices do not divide the model's 4 query heads"),
    (0, "parallel.tensor: must be >= 1"),
])
def test_tensor_parallel_that_cannot_split_the_model_is_refused(tensor, message):
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(tiny_config(), tensor)


def test_parallel_config_section(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[parallel]\ntensor = 2\n[buckets]\ndecode_batch = [1, 32]\nprefill_tokens = [512]\n")
    assert load_config(str(path)).tensor_parallel == 2
    path.write_text("[parallel]\ntensors = 2\n[buckets]\ndecode_batch = [1, 32]\nprefill_tokens = [512]\n")
    with pytest.raises(ValueError, match=r"unknown setting in \[parallel\]: \['tensors'\]"):
        load_config(str(path))
    with pytest.raises(ValueError, match="parallel.tensor: must be an integer >= 1"):
        make_config(tensor_parallel=0)


def test_memory_plan_is_per_device_and_names_replicated_kv_heads():
    from jaxcb.host import memory_plan

    c = tiny_config(vocab_size=256, num_heads=8, num_kv_heads=2)
    common = dict(budget_bytes=64 << 20, fraction=0.9, weight_bytes=c.num_params * 4, num_layers=c.num_layers,
                  num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, hidden_size=c.hidden_size,
                  intermediate_size=c.intermediate_size, vocab_size=c.vocab_size, dtype_bytes=4, page_size=16,
                  max_context=256, max_batch=8, max_prefill_tokens=64, num_heads=c.num_heads)
    one, two, eight = (memory_plan.plan(**common, tensor=n) for n in (1, 2, 8))
    assert two.weight_bytes * 2 >= one.weight_bytes > two.weight_bytes
    assert two.kv_bytes_per_token * 2 == one.kv_bytes_per_token  # one KV head each
    assert eight.kv_bytes_per_token == two.kv_bytes_per_token  # one copy of one head each
    assert (one.kv_replication, two.kv_replication, eight.kv_replication) == (1, 1, 4)
    assert two.num_pages > one.num_pages and "per device" in two.describe()
    assert "replicated" in eight.describe() and "replicated" not in two.describe()


def test_plan_command_takes_tensor_parallel(capsys):
    """An 8B Llama (config.json only) on a 16 GiB chip: does not fit one, fits four."""
    from jaxcb.cli import main

    assert main(["plan", "--model", os.path.join(HERE, "..", "configs", "models", "llama-3-8b"), "--memory",
                 "16GiB", "--max-context", "4096", "--tensor-parallel", "4"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel 4: every figure below is per device" in out
    assert "weights       3.7 GiB" in out  # 8.0B parameters in bfloat16, a quarter each
    assert main(["plan", "--model", os.path.join(HERE, "..", "configs", "models", "llama-3-8b"), "--memory",
                 "16GiB", "--max-context", "4096", "--tensor-parallel", "1"]) == 2
    assert "memory: 16.0 GiB x 0.9 = 14.4 GiB holds the weights (15.0 GiB)" in capsys.readouterr().err
