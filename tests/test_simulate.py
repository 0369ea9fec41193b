"""Traces and the simulator: the real scheduler on a simulated clock (no JAX)."""

import json
import re
import subprocess
import sys

import pytest

from jaxcb.host.engine_config import make_config
from jaxcb.host.latency import quantile
from jaxcb.sim.simulate import DEVICES, MODELS, FittedStepModel, RooflineStepModel, StepStats, load_step_model, simulate
from jaxcb.sim.trace import RequestRecord, TraceRequest, load_trace, prompt_ids, read_trace, summarize, write_trace


class Constant:
    """Every step takes the same time."""

    def __init__(self, seconds):
        self.s = seconds
        self.seen = []

    def seconds(self, stats):
        self.seen.append(stats)
        return self.s


def test_trace_files_round_trip_and_bad_lines_name_line_and_field(tmp_path):
    trace = [TraceRequest(0.5, 30, 8, priority=2, prefix_id=1, prefix_tokens=16), TraceRequest(0.1, 5, 3)]
    path = tmp_path / "t.jsonl"
    write_trace(str(path), trace)
    back = read_trace(str(path))
    assert [r.arrival_s for r in back] == [0.1, 0.5]  # sorted by arrival
    assert back[1] == trace[0]
    path.write_text('{"arrival_s": 0, "prompt_tokens": 4, "output_tokens": 2}\n{"arrival_s": 1, "output_tokens": 2}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2: prompt_tokens: must be an integer from 1"):
        read_trace(str(path))
    ok = '"prompt_tokens": 4, "output_tokens": 2'
    for line, message in (('{"arrival_s": -1, %s}' % ok, "arrival_s: must be a finite number of seconds >= 0"),
                          ('{"arrival_s": NaN, %s}' % ok, "arrival_s: must be a finite number"),  # (a hang before)
                          ('{"arrival_s": Infinity, %s}' % ok, "arrival_s: must be a finite number"),
                          ('{"arrival_s": "1", %s}' % ok, "arrival_s: must be a finite number"),
                          ('{"arrival_s": 0, "prompt_tokens": 4.5, "output_tokens": 2}', "prompt_tokens: must be an integer"),
                          ('{"arrival_s": 0, "prompt_tokens": 99999999, "output_tokens": 2}', "prompt_tokens: must be an integer from 1 to"),
                          ('{"arrival_s": 0, %s, "priority": 2.7}' % ok, "priority: must be an integer"),
                          ('{"arrival_s": 0, %s, "prioirty": 1}' % ok, "prioirty: not a field of a trace line"),
                          ('{"arrival_s": 0, %s, "prefix_id": {}}' % ok, "prefix_id: must be an integer or a string"),
                          ('{"arrival_s": 0, "prompt_token_ids": "123", "output_tokens": 2}', "prompt_token_ids: must be a list"),
                          ("[1, 2, 3]", "must be a JSON object")):
        path.write_text(line + "\n")
        with pytest.raises(ValueError, match="t.jsonl:1: " + re.escape(message)):
            read_trace(str(path))
    path.write_bytes(b'\xef\xbb\xbf{"arrival_s": 0, "prompt_tokens": 4, "output_tokens": 2, "prefix_id": "a\xe2\x80\xa8b"}\n')
    assert len(read_trace(str(path))) == 1  # (a byte-order mark; U+2028 inside a string is no line's end)
    path.write_bytes(b'{"arrival_s": 0, "prompt_tokens": 4, "output_tokens": 2}\n{"arrival_s": 0\xe9}\n')
    with pytest.raises(ValueError, match="t.jsonl:2: 'utf-8' codec"):
        read_trace(str(path))
    with pytest.raises(ValueError, match="No such file"):
        read_trace(str(tmp_path / "missing.jsonl"))


def test_a_trace_whose_requests_cannot_run_is_refused_as_the_engine_refuses_them():
    """simulate takes each request as a served engine would: one longer than the context (or the pool) is refused
    and counted, with the first refusals' reasons, not cut to fit; a trace whose last requests are refused ends
    (it raised an IndexError)."""
    from jaxcb.sim.simulate import load_step_model, simulate

    config = make_config(num_pages=64, max_context=256, decode_batch=(1, 2), prefill_tokens=(32,), max_prefill_tokens=32)
    trace = [TraceRequest(0.0, 20, 4), TraceRequest(0.1, 5000, 4), TraceRequest(0.2, 200, 100)]
    out = simulate(trace, config, load_step_model())
    assert out["requests"] == 1 and out["rejected"] == 2, out
    assert "prompt" in out["rejected_first"][0] and "max_tokens" in out["rejected_first"][1]
    assert "prompt: 5000 tokens; the limit is 255" in out["rejected_first"][0]  # (its own length, not the cut one's)
    for bad in ({"32": -1.0}, {"32": float("nan")}, {}):  # (a step model of impossible times: every latency 0 before)
        with pytest.raises(ValueError, match="intercepts_s"):
            FittedStepModel.from_json({"intercepts_s": bad, "per_context_token_s": 0.0})


def test_requests_with_one_prefix_id_share_their_prefix_tokens():
    trace = [TraceRequest(0, 40, 1, prefix_id=7, prefix_tokens=24), TraceRequest(0, 30, 1, prefix_id=7, prefix_tokens=24),
             TraceRequest(0, 40, 1), TraceRequest(0, 3, 1, prompt_token_ids=[5, 6, 7])]
    ids = prompt_ids(trace, vocab=1000, seed=3)
    assert [len(x) for x in ids] == [40, 30, 40, 3]
    assert ids[0][:24] == ids[1][:24] and ids[0][24:30] != ids[1][24:30]
    assert ids[2][:24] != ids[0][:24] and ids[3] == [5, 6, 7]
    assert ids == prompt_ids(trace, vocab=1000, seed=3)  # reproducible


def test_requests_share_the_tokens_of_their_first_equal_block_hashes():
    """hash_ids (Mooncake's blocks): two prompts share exactly the blocks up to their first different hash, a
    hash's tokens are the same wherever it stands; a line's hash_ids must cover its prompt in whole blocks."""
    trace = [TraceRequest(0, 20, 1, hash_ids=(1, 2, 3), block_tokens=8), TraceRequest(0, 22, 1, hash_ids=(1, 2, 4),
             block_tokens=8), TraceRequest(0, 9, 1, hash_ids=(5, 2), block_tokens=8)]
    ids = prompt_ids(trace, vocab=1000, seed=3)
    assert [len(x) for x in ids] == [20, 22, 9]
    assert ids[0][:16] == ids[1][:16] and ids[0][16:20] != ids[1][16:20] and ids[2][:8] != ids[0][:8]
    assert ids[2][8:] == ids[0][8:9]  # (hash 2, the second block of both)
    assert ids == prompt_ids(trace, vocab=1000, seed=3) and prompt_ids(trace, vocab=1000, seed=4) != ids
    assert [len(x) for x in prompt_ids(trace, vocab=1000, limit=10)] == [10, 10, 9]


def test_public_traces_are_read_as_published(tmp_path):
    """Mooncake's JSONL (ms, 512-token blocks), Azure's CSV (dates, 7-digit fractions) and BurstGPT's CSV
    (seconds, failed rows of no response): arrivals in seconds from the first, sorted, rows without output left out
    and said; a bad row names its line and column; a CSV of other columns names the ones a trace needs."""
    mooncake = tmp_path / "m.jsonl"
    mooncake.write_text("\n".join(json.dumps(d) for d in (
        {"timestamp": 1500, "input_length": 600, "output_length": 7, "hash_ids": [0, 1]},
        {"timestamp": 1000, "input_length": 512, "output_length": 3, "hash_ids": [0]},
        {"timestamp": 2000, "input_length": 10, "output_length": 0, "hash_ids": [9]})) + "\n")
    notes = []
    got = read_trace(str(mooncake), notes)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens, r.hash_ids) for r in got] == [
        (0.0, 512, 3, (0,)), (0.5, 600, 7, (0, 1))]
    assert notes == [f"{mooncake}: 1 requests with no prompt or no output tokens (failed requests) left out"]
    ids = prompt_ids(got, vocab=49152)
    assert ids[1][:512] == ids[0] and len(ids[1]) == 600
    azure = tmp_path / "a.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
                     "2023-11-16 18:15:46.1000000,396,109\n2023-11-16 18:16:00.0000000,20,0\n")
    got = read_trace(str(azure))
    assert [(round(r.arrival_s, 4), r.prompt_tokens, r.output_tokens) for r in got] == [(0.0, 396, 109), (0.5806, 374, 44)]
    # the 2024 files' offsets and shorter fractions: an offset is the instant it says; none is UTC
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-12 00:00:00.5-08:00,1,2\n"
                     "2024-05-12 00:00:00+00:00,3,4\n2024-05-12T00:00:01.001163Z,5,6\n2024-05-12 00:00:02,7,8\n")
    assert [(round(r.arrival_s, 6), r.prompt_tokens) for r in read_trace(str(azure))] == [
        (0.0, 3), (1.001163, 5), (2.0, 7), (28800.5, 1)]
    with pytest.raises(ValueError, match=re.escape("--time-scale: 1e+308 puts arrivals past what a number of seconds")):
        load_trace(str(azure), time_scale=1e308)
    burst = tmp_path / "b.csv"
    burst.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                     "5,ChatGPT,472,18,490,Conversation log\n45,GPT-4,1087,0,1087,Conversation log\n"
                     "7.5,ChatGPT,30,230,260,API log\n")
    notes = []
    assert [(r.arrival_s, r.prompt_tokens) for r in read_trace(str(burst), notes)] == [(0.0, 472), (2.5, 30)]
    assert len(notes) == 1
    for path, text, message in (
            (mooncake, '{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1]}\n',
             "m.jsonl:1: hash_ids: 1 blocks of 512 tokens for input_length 600 (must be 2)"),
            (mooncake, '{"timestamp": 0, "input_length": 6, "output_length": 2, "hash_ids": [1], "x": 1}\n',
             "m.jsonl:1: x: not a field of a Mooncake trace line"),
            (mooncake, '{"timestamp": -5, "input_length": 6, "output_length": 2, "hash_ids": [1]}\n',
             "m.jsonl:1: timestamp: must be a finite number of milliseconds"),
            (azure, "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,12,3\nyesterday,4,5\n",
             "a.csv:3: TIMESTAMP: 'yesterday' is not a date and time"),
            (azure, "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1.5,3\n",
             "a.csv:2: ContextTokens: must be an integer from 0"),
            (azure, "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,\u00b2,3\n",
             "a.csv:2: ContextTokens: must be an integer from 0"),  # (a superscript: a digit to str, not to int)
            (burst, "Timestamp,Request tokens,Response tokens\n1,2\n", "b.csv:2: 2 columns, the header has 3"),
            (burst, "time,prompt,output\n1,2,3\n", "b.csv:1: a trace's CSV header names TIMESTAMP, ContextTokens, "
             "GeneratedTokens or Timestamp, Request tokens, Response tokens")):
        path.write_text(text)
        with pytest.raises(ValueError, match=re.escape(message)):
            read_trace(str(path))


def test_summary_figures_from_records():
    recs = [RequestRecord(0.0, 0.0, 1.0, 5.0, 5), RequestRecord(1.0, 3.0, 4.0, 6.0, 3)]
    s = summarize(recs, preemptions=2)
    assert s["span_s"] == 6.0 and s["output_tokens_per_s"] == round(8 / 6, 2)
    assert s["ttft_p50_s"] == 2.0 and s["max_wait_s"] == 2.0 and s["preemptions"] == 2
    assert s["tpot_p99_s"] == pytest.approx(quantile([1.0, 1.0], 0.99))
    assert quantile([1, 2, 3, 4], 0.5) == 2.5


def test_one_request_on_a_constant_clock():
    config = make_config(num_pages=64, max_context=256, page_size=16, decode_batch=(1, 2, 4),
                         prefill_tokens=(16, 32, 64))
    model = Constant(1.0)
    s = simulate([TraceRequest(2.0, 10, 5)], config, model)
    # One prefill step then four decode steps, a second each, from the arrival at 2 s.
    assert s["ttft_p50_s"] == 1.0 and s["e2e_p99_s"] == 5.0 and s["tpot_p50_s"] == 1.0
    assert s["simulated_s"] == 7.0 and s["steps"] == 5
    assert [st.padded_tokens for st in model.seen] == [20, 1, 1, 1, 1]  # token buckets: 4 + 16 holds 10
    assert [st.context for st in model.seen] == [10, 11, 12, 13, 14]


def test_async_scheduling_keeps_a_finishing_request_in_its_slot_one_more_step():
    """As in Engine.step(): step N+1 is scheduled while step N runs, so a request whose last token is in
    flight still holds its slot, and the one waiting for that slot joins a step later than when every
    step's tokens are back before the next is scheduled."""
    config = make_config(num_pages=64, max_context=256, page_size=16, decode_batch=(1, 2),
                         prefill_tokens=(16, 32, 64))
    trace = [TraceRequest(0.0, 10, 3), TraceRequest(0.0, 10, 20), TraceRequest(0.0, 10, 3)]
    serial = simulate(trace, config.replace(async_scheduling=False), Constant(1.0))
    pipelined = simulate(trace, config, Constant(1.0))
    # A and B prefill in step 1; A's third token comes from step 3. Serial: C prefills in step 4.
    # Pipelined: step 4 was planned while A's last token was in flight, so C prefills in step 5.
    assert serial["ttft_p99_s"] == pytest.approx(quantile([1.0, 1.0, 4.0], 0.99))
    assert pipelined["ttft_p99_s"] == pytest.approx(quantile([1.0, 1.0, 5.0], 0.99))
    assert pipelined["output_tokens"] == serial["output_tokens"] == 26


def test_the_simulator_runs_the_real_policies():
    config = make_config(num_pages=256, max_context=256, decode_batch=(1, 2), prefill_tokens=(16, 32, 64))
    trace = [TraceRequest(0.01 * i, 20, 40) for i in range(6)]
    fcfs = simulate(trace, config, Constant(0.01))
    rr = simulate(trace, config.replace(policy="round-robin", quantum_tokens=8), Constant(0.01))
    assert fcfs["switches"] == 0 and rr["switches"] > 0
    assert rr["ttft_p99_s"] < fcfs["ttft_p99_s"]  # turns: nobody waits for two whole requests
    assert rr["output_tokens"] == fcfs["output_tokens"] == 240
    tiny = simulate(trace, config.replace(num_pages=8), Constant(0.01))  # 7 pages of 16: preemptions
    assert tiny["preemptions"] > 0 and tiny["output_tokens"] == 240


def test_a_fitted_model_recovers_its_coefficients():
    steps = [{"padded_tokens": t, "context": c, "seconds": {1: 0.02, 32: 0.05}[t] + 2e-6 * c}
             for t in (1, 32) for c in range(100, 5000, 700)]
    m = FittedStepModel.fit(steps)
    assert m.per_context_token == pytest.approx(2e-6, rel=1e-6)
    assert m.intercept(1) == pytest.approx(0.02) and m.intercept(32) == pytest.approx(0.05)
    assert m.intercept(16) == pytest.approx(0.02 + 15 * 0.03 / 31)  # interpolated between buckets
    assert m.error(steps)["mean_abs_error_frac"] < 1e-6


def test_a_fitted_model_separates_prefill_attention_from_context():
    """Prefill chunks compute ~n^2/2 attention pairs beyond their context: a slope of its own."""
    steps = []
    for t in (1, 32, 64):
        for c in range(100, 5000, 700):
            for extra in (0, 300, 2000):  # decode-only steps have none
                pairs = c + (extra if t > 1 else 0)
                steps.append({"padded_tokens": t, "context": c, "attention_pairs": pairs,
                              "seconds": {1: 0.02, 32: 0.05, 64: 0.08}[t] + 2e-6 * c + 5e-7 * (pairs - c)})
    m = FittedStepModel.fit(steps)
    assert m.per_context_token == pytest.approx(2e-6, rel=1e-6)
    assert m.per_extra_pair == pytest.approx(5e-7, rel=1e-6)
    assert m.error(steps)["mean_abs_error_frac"] < 1e-6
    back = FittedStepModel.from_json(json.loads(json.dumps(m.to_json())))
    assert back.seconds(StepStats(64, 40, 900, 2900, 2, 1)) == pytest.approx(0.08 + 2e-6 * 900 + 5e-7 * 2000)


def test_the_builtin_step_model_loads():
    m = load_step_model()
    assert m.seconds(StepStats(1, 1, 100, 100, 1, 1)) > 0
    assert m.seconds(StepStats(m.buckets[-1], 500, 3000, 0, 32, 32)) > m.seconds(StepStats(1, 1, 100, 100, 1, 1))


def test_roofline_decode_is_memory_bound_and_a_big_prefill_compute_bound():
    m = RooflineStepModel(DEVICES["h200"], MODELS["llama-3-8b"])
    decode = m.seconds(StepStats(1, 1, 1000, 1000, 1, 1))
    weights = MODELS["llama-3-8b"].params * 2
    assert decode == pytest.approx(weights / (4.8e12 * 0.7) + 0.0005, rel=0.01)
    prefill = m.seconds(StepStats(8192, 8192, 8192, 8192 * 4096, 1, 1))
    assert prefill > 8192 * 2 * MODELS["llama-3-8b"].params / (989e12 * 0.5)
    assert m.num_pages(16) > 40000  # ~110 GB of an H200 for KV at 128 KiB a token


def test_simulate_command_prints_the_table_as_json_last(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(str(path), [TraceRequest(0.05 * i, 30 + i, 10) for i in range(20)])
    out = subprocess.run([sys.executable, "-m", "jaxcb", "simulate", "--trace", str(path), "--policy", "sjf"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "max_wait_s",
                "preemptions"):
        assert key in result
    assert result["requests"] == 20 and result["output_tokens"] == 200
    # A public trace's shared blocks are the prefix cache's hits; --requests and --time-scale take a slice, slower
    mooncake = tmp_path / "m.jsonl"
    mooncake.write_text("".join(json.dumps({"timestamp": 2000 * i, "input_length": 700, "output_length": 4,
                                            "hash_ids": [0, 100 + i]}) + "\n" for i in range(6)))
    out = subprocess.run([sys.executable, "-m", "jaxcb", "simulate", "--trace", str(mooncake), "--requests", "4",
                          "--time-scale", "10"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["requests"] == 4 and result["prefix_cache_hit_tokens"] == 3 * 512
    assert result["prompt_tokens_computed"] == 4 * 700 - 3 * 512 and result["simulated_s"] >= 60.0  # (arrivals 20 s apart)
    bad = subprocess.run([sys.executable, "-m", "jaxcb", "simulate", "--trace", str(path), "--device", "h300"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--device: 'h300' is not one of" in bad.stderr


def test_fair_policy_serves_each_traces_client_its_share(tmp_path):
    """A trace's `client`: the simulator runs the fair policy's flows with it and reports each client; one client's
    flood leaves the others' first tokens waiting for it under fcfs, not under fair, at the same throughput."""
    import json

    from jaxcb.sim.simulate import load_step_model, simulate
    from jaxcb.sim.trace import load_trace

    config = make_config(num_pages=512, max_context=512, page_size=16, decode_batch=(1, 2, 4, 8),
                         prefill_tokens=(64, 256), max_prefill_tokens=256, quantum_tokens=16)
    path = tmp_path / "t.jsonl"
    lines = [{"arrival_s": i * 0.01, "prompt_tokens": 200, "output_tokens": 200, "client": "flood"} for i in range(60)]
    lines += [{"arrival_s": 1.0 + 2.0 * i, "prompt_tokens": 50, "output_tokens": 16, "client": "chat"} for i in range(5)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = {p: simulate(load_trace(str(path)), config.replace(policy=p), load_step_model()) for p in ("fcfs", "fair")}
    assert set(out["fair"]["clients"]) == {"flood", "chat"} and out["fair"]["clients"]["chat"]["requests"] == 5
    assert out["fair"]["clients"]["chat"]["ttft_p99_s"] * 10 < out["fcfs"]["clients"]["chat"]["ttft_p50_s"]
    assert out["fair"]["output_tokens_per_s"] > 0.95 * out["fcfs"]["output_tokens_per_s"]
    with pytest.raises(ValueError, match="client: must be a string"):
        path.write_text(json.dumps({"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 5, "client": 7}) + "\n")
        load_trace(str(path))


def test_a_request_is_its_tokens_client_or_its_gateways_fairness_id():
    from serve import frontend

    class Options:
        tokens = ()

    state = frontend.State.__new__(frontend.State)
    state.options = Options()
    frontend.read_fairness("team-a")
    assert state.client("peer:http:1.2.3.4:5") == "team-a"
    frontend.read_fairness(None)
    assert state.client("peer:http:1.2.3.4:5") == ""
    state.options.tokens = ("s3cret",)
    frontend.read_fairness("someone-else")  # (with tokens what a request says of itself changes nothing)
    assert state.client("token0") == "token0"
