"""XLA:CPU's dot library chosen per CPU (jaxcb.device.cpu_dots): the rule, the one-off measurement and its
cache, the operator's overrides, and each library forced on the real model (its own process, as XLA reads
its flags once), which must give the golden tokens or be refused with a clear error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest

from jaxcb.device import cpu_dots

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))

AMD = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse2 avx2 avx512f avx512_vnni avx512_bf16

processor\t: 1
vendor_id\t: AuthenticAMD
model name\t: something else
flags\t\t: fpu
"""
INTEL = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8488C
flags\t\t: fpu avx2 avx512f amx_tile amx_bf16 amx_int8
"""


@pytest.fixture
def clean(monkeypatch, tmp_path):
    """No override in the environment, a cache of this test's own."""
    monkeypatch.delenv("JAXCB_CPU_DOTS", raising=False)
    monkeypatch.setenv("JAXCB_CPU_DOTS_CACHE", str(tmp_path / "cpu-dots.json"))
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setattr(cpu_dots, "_applied", None)


def test_cpu_info_reads_the_first_processor():
    info = cpu_dots.cpu_info(AMD)
    assert (info.vendor, info.model) == ("AuthenticAMD", "AMD EPYC 9R14")
    assert {"avx512f", "avx512_bf16"} <= info.flags and "fpu" in info.flags
    assert not info.amx_usable  # no amx_tile listed
    assert cpu_dots.cpu_info(INTEL).key != info.key


def test_auto_follows_the_measured_family_and_measures_any_other_cpu_once(clean, monkeypatch):
    calls = []

    def fake_measure(isa, *a, **k):
        calls.append(isa)
        return {"default": {"float32@32": 100.0, "float32@512": 150.0},
                "xnn": {"float32@32": 125.0, "float32@512": 170.0},
                "ynn": {"float32@32": 104.0, "float32@512": 155.0}}

    monkeypatch.setattr(cpu_dots, "measure_libraries", fake_measure)
    monkeypatch.setattr(cpu_dots, "_accelerator_expected", lambda: False)
    amd = cpu_dots.choose(info=cpu_dots.cpu_info(AMD))
    assert (amd.library, amd.isa, amd.compute_dtype) == ("default", "", "float32") and "AMD" in amd.reason
    assert calls == []  # a family measured before: no measurement
    intel = cpu_dots.cpu_info(INTEL)
    first = cpu_dots.choose(info=intel)
    assert first.library == "xnn" and "measured on this CPU" in first.reason  # 1.17x over the default
    assert cpu_dots.choose(info=intel) == first and len(calls) == 1  # cached: measured once
    with open(os.environ["JAXCB_CPU_DOTS_CACHE"]) as f:
        assert intel.key in json.load(f)


def test_a_library_must_beat_the_default_by_the_margin():
    rates = {"default": {"float32@32": 100.0, "float32@512": 100.0},
             "eigen": {"float32@32": 108.0, "float32@512": 108.0}}
    assert cpu_dots.pick(rates) == "default"
    rates["eigen"] = {"float32@32": 120.0, "float32@512": 105.0}
    assert cpu_dots.pick(rates) == "eigen"
    assert cpu_dots.pick({"ynn": {"float32@32": 1.0}}) == "ynn"  # the default did not run at all


def test_the_operator_decides_first(clean, monkeypatch):
    monkeypatch.setattr(cpu_dots, "probe", lambda lib, isa="": None)
    amd = cpu_dots.cpu_info(AMD)
    assert cpu_dots.choose("eigen", info=amd).library == "eigen"
    monkeypatch.setenv("JAXCB_CPU_DOTS", "ynn")
    assert cpu_dots.choose(info=amd).library == "ynn"
    assert cpu_dots.choose("xnn", info=amd).library == "xnn"  # the flag or config before the environment
    monkeypatch.delenv("JAXCB_CPU_DOTS")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2 --xla_cpu_use_xnnpack=false")
    kept = cpu_dots.choose(info=amd)
    assert kept.library == "xla_flags" and "--xla_cpu_use_xnnpack=false" in kept.reason
    with pytest.raises(ValueError, match="cpu_dots: 'mkl' is not one of"):
        cpu_dots.choose("mkl", info=amd)


def test_a_library_that_dies_here_is_refused_naming_why(clean, monkeypatch):
    monkeypatch.setattr(cpu_dots, "probe", lambda lib, isa="": "killed by SIGILL: partition compile failed")
    with pytest.raises(ValueError, match=r"cpu_dots: 'onednn' does not run on this CPU \(killed by SIGILL"):
        cpu_dots.choose("onednn", info=cpu_dots.cpu_info(AMD))


def test_amx_listed_but_not_granted_caps_the_isa(clean, monkeypatch):
    monkeypatch.setattr(cpu_dots, "_amx_granted", lambda: False)  # as on a VM that lists AMX only
    listed = cpu_dots.cpu_info(INTEL)
    assert not listed.amx_usable
    choice = cpu_dots.choose("default", info=listed)
    assert choice.isa == "AVX512_BF16" and "--xla_cpu_max_isa=AVX512_BF16" in choice.xla_flags()
    granted = cpu_dots.CpuInfo(listed.vendor, listed.model, listed.flags, amx_usable=True)
    assert cpu_dots.choose("default", info=granted).isa == ""


def test_the_config_key_and_flag_are_checked():
    from jaxcb.cli import build_parser
    from jaxcb.cli.args import engine_config
    from jaxcb.host.engine_config import make_config

    with pytest.raises(ValueError, match="model.cpu_dots: 'fast' is not one of"):
        make_config(cpu_dots="fast")
    args = build_parser().parse_args(["generate", "--cpu-dots", "eigen", "hi"])
    assert engine_config(args).cpu_dots == "eigen"


def test_applying_after_jax_started_reports_what_holds(clean, monkeypatch):
    monkeypatch.setattr(cpu_dots, "backend_started", lambda: True)
    held = cpu_dots.apply(cpu_dots.DotChoice("eigen", "", "float32", "asked for"))
    assert held.library == "default" and "JAX had started" in held.reason
    assert os.environ["XLA_FLAGS"] == "" and cpu_dots.current() == held


def test_the_measurement_runs_each_library_in_its_own_process(clean):
    rates = cpu_dots.measure_libraries(rows=(4,), layers=2, k=32, n=64, libraries=("default", "eigen"), quiet=True)
    assert set(rates) == {"default", "eigen"} and all(r["float32@4"] > 0 for r in rates.values())


# What the compiled HLO of a dot shows under each library (jaxlib 0.10.2).
FUSIONS = {"ynn": ["__ynn_fusion"], "onednn": ["__onednn_fusion"], "xnn": [], "eigen": []}


@pytest.mark.parametrize("library", sorted(FUSIONS))
def test_each_library_gives_the_golden_tokens_or_is_refused(library, golden, config_path):
    """`default` is the library of every other test; each other one runs SmolLM2 greedy in its own
    process (tests/dots_golden.py). One that cannot run on this CPU (oneDNN dies with SIGILL on the AMD
    VMs) must be refused by `jaxcb generate --cpu-dots` with exit 2 and the reason, not crash the engine."""
    env = dict(os.environ)
    env.pop("JAXCB_CPU_DOTS", None)
    if cpu_dots.probe(library):
        proc = subprocess.run([sys.executable, "-m", "jaxcb", "generate", "--cpu-dots", library, "--config",
                               config_path, "hi"], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert f"cpu_dots: '{library}' does not run on this CPU" in proc.stderr
        return
    proc = subprocess.run([sys.executable, "-m", "tests.dots_golden",
                           os.path.join(HERE, "golden", "smollm2.json"), library],
                          env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["library"] == library and out["fusions"] == FUSIONS[library]
    from tests.parity import check_against_golden

    outs = [types.SimpleNamespace(token_ids=t) for t in out["tokens"]]
    n = len(outs[0].token_ids)  # tests/dots_golden.py STEPS: the first n golden tokens
    records = [{**r, "greedy_ids": r["greedy_ids"][:n], "margins": r["margins"][:n]} for r in golden["records"][::2]]
    check_against_golden(outs, {**golden, "records": records})
