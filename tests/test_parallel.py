"""Tensor parallelism (jaxcb.parallel): the sharded step gives the single-device tokens.

Meshes need forced host devices, which must be set before JAX starts: the engines run in a
subprocess (tests/tp_check.py)."""

import json
import os
import subprocess
import sys
import types

import pytest

from jaxcb.engine_config import load_config, make_config
from jaxcb.model.config import tiny_config
from jaxcb.parallel import check_tensor_parallel

HERE = os.path.dirname(os.path.abspath(__file__))
HELPER = os.path.join(HERE, "tp_check.py")


def test_tensor_parallel_gives_the_single_device_tokens(tmp_path):
    proc = subprocess.run([sys.executable, HELPER, str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # [L, 2, K, P, S, D]: one device holds both KV heads; under TP 2 each device holds one, every page.
    assert [s[2:4] for s in out["tp1"]["kv_shards"]] == [[2, 16]]
    assert [s[2:4] for s in out["tp2"]["kv_shards"]] == [[1, 16], [1, 16]]
    assert out["tp1"]["preemptions"] > 0  # a pool tight enough to preempt under the mesh too
    for name in ("tp2", "tp2-pallas"):
        assert out[name]["tokens"] == out["tp1"]["tokens"], name
        assert out[name]["compilations_after_warmup"] == 0, name


def test_smollm2_at_tensor_parallel_3_gives_the_golden_tokens(golden):
    """9 query heads and 3 KV heads over 3 devices: one KV head each; the reference greedy tokens."""
    from test_model_parity import check_against_golden

    proc = subprocess.run([sys.executable, os.path.join(HERE, "tp_golden.py"), os.path.join(HERE, "golden", "smollm2.json")],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [s[2] for s in out["kv_shards"]] == [1, 1, 1]
    outs = [types.SimpleNamespace(token_ids=t) for t in out["tokens"]]
    full = check_against_golden(outs, golden)
    print(f"TP 3: {full}/{len(outs)} golden prompts identical in full")


@pytest.mark.parametrize("tensor, message", [
    (3, "parallel.tensor: 3 devices do not divide the model's 4 query heads"),
    (4, "parallel.tensor: 4 devices do not divide the model's 2 KV heads"),
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
