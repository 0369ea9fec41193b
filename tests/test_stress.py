"""The stress suite at small scale (tools/stress.py; `make stress` runs it in full): cancels, fuzzing,
slow and giant clients, injected faults, SIGTERM under load. Nothing lost, leaked or crashed."""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_small_stress_suite_loses_nothing():
    proc = subprocess.run([sys.executable, "-m", "tools.stress", "--scale", "small", "--json"],
                          capture_output=True, text=True, timeout=1200, cwd=os.path.dirname(HERE))
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    st, fz, sl, fa, sg, mem = (r[k] for k in ("streams", "fuzz", "slow", "faults", "sigterm", "memory"))
    assert st["lost"] == 0 and st["two_finals"] == 0 and st["error"] == 0
    assert st["final"] + st["cancelled"] == 60 and st["cancelled"] > 0
    assert st["pages_leaked"] == fz["pages_leaked"] == sl["pages_leaked"] == fa["pages_leaked"] == 0
    assert st["compilations_after_warmup"] == 0
    assert fz["fuzzed"] == 300 and fz["raw"] == 50 and not fz["crashed"]
    assert fz["raw_other"] == 0, fz["raw_statuses"]  # a body that does not parse: INVALID_ARGUMENT
    assert fz["other_status"] == 0, fz.get("other_examples")
    assert fz["unnamed_errors"] == 0, fz.get("unnamed_examples")
    assert fz["healthy_runs"] > 0 and fz["healthy_mismatches"] == 0
    assert fa["raised"] + fa["error_state"] > 0 and fa["internal"] > 0
    assert fa["different"] == 0 and fa["other"] == 0 and fa["internal"] + fa["identical"] == fa["requests"]
    assert sg["lost"] == 0 and sg["other_ends"] == 0 and sg["exit_code"] == 0
    assert sg["finished_length"] + sg["finished_abort"] == sg["streams"]
    for scenario in (st, fz, sl, mem):
        assert scenario["exit_code"] == 0
    # New weights while serving: clients streaming through updates, pauses and sleeps.
    w = r["weights"]
    assert w["lost"] == 0 and w["errors"] == 0 and w["mismatched"] == 0 and w["checked"] > 0
    assert w["updates"] > 0 and w["pauses"] > 0 and w["sleeps"] > 0
    assert w["pages_leaked"] == 0 and w["compilations_after_warmup"] == 0 and w["exit_code"] == 0
    # The same over the OpenAI HTTP API.
    h = r["http"]
    assert h["streams"]["lost"] == 0 and h["streams"]["error"] == 0 and h["streams"]["cancelled"] > 0
    assert sum(h["streams"].values()) == 60
    assert set(h["statuses"]) <= {"200", "400", "404", "413", "429"}, h["statuses"]
    assert h["statuses"].get("400", 0) > 0 and h["statuses"].get("200", 0) > 0, h["statuses"]
    assert h["unnamed_errors"] == 0, h.get("unnamed_examples")
    assert h["healthy_runs"] > 0 and h["healthy_mismatches"] == 0
    assert h["oversized_status"] == 413
    assert set(h["flood"]) <= {"200", "429"} and h["flood"].get("429", 0) > 0, h["flood"]
    assert h["pages_leaked"] == 0 and not h["crashed"] and h["compilations_after_warmup"] == 0
    assert h["sigterm_exit_code"] == 0 and h["sigterm_shutdown_s"] < 15
