"""LoRA adapters (jaxcb.host.lora, jaxcb.model.lora, jaxcb.device.lora): PEFT directories written here,
served in one batch with the base model, against models with the adapters merged into their weights
(computed here, from the PEFT tensors)."""

import dataclasses
import json
import os

import numpy as np
import pytest

from jaxcb.host.errors import InvalidConfig, InvalidRequest, NotFound
from jaxcb.host.lora import LoraConfig
from jaxcb.host.request import SamplingParams
from tests.lora_util import merged_weights, write_adapter

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_model):
    """Three adapters of the tiny model: all projections at rank 4; q/v/down at rank 8 with a per-module
    rank and alpha; the MLP only, in some layers, with rsLoRA scaling."""
    cfg = tiny_model[0]
    root = tmp_path_factory.mktemp("adapters")
    raw = {
        "all4": write_adapter(str(root / "all4"), cfg, rank=4, seed=1),
        "qvd8": write_adapter(str(root / "qvd8"), cfg, rank=8, targets=("wq", "wv", "w_down"), seed=2,
                              rank_pattern={"v_proj": 2}, alpha_pattern={"down_proj": 4.0}),
        "mlp": write_adapter(str(root / "mlp"), cfg, rank=4, targets=("w_gate", "w_up", "w_down"), seed=3,
                             layers=[1], extra_config={"use_rslora": True}),
    }
    for (t, i), (a, b, s) in raw["mlp"].items():  # rsLoRA: alpha / sqrt(r)
        raw["mlp"][(t, i)] = (a, b, s * a.shape[0] / np.sqrt(a.shape[0]))
    return {name: str(root / name) for name in raw}, raw


def _merged_llm(make_llm, tiny_model, raw):
    from jaxcb.model.llama import params_from_numpy, params_to_weights

    cfg, params, tok, eos = tiny_model
    weights = {k: np.asarray(v) for k, v in params_to_weights(params).items()}
    return make_llm(model=(cfg, params_from_numpy(merged_weights(weights, raw)), tok, eos))


def _prompts(vocab, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]


def test_a_batch_mixing_adapters_gives_each_merged_models_tokens(make_llm, tiny_model, adapters):
    paths, raw = adapters
    llm = make_llm(lora=LoraConfig(max_loras=3, max_rank=8))
    for name, path in paths.items():
        llm.engine.load_lora(name, path)
    names = ["", "all4", "qvd8", "mlp", "all4", "", "qvd8", "mlp"]
    prompts = _prompts(llm.model_config.vocab_size, (5, 17, 30, 9, 40, 12, 3, 25))
    compiled = None
    llm.warmup()
    compiled = llm.engine.stats().compilations
    got = llm.generate(prompts, [dataclasses.replace(GREEDY, lora=n) for n in names])
    assert llm.engine.stats().compilations == compiled  # adapters in and out of slots: no new program
    reference = {"": make_llm(), **{n: _merged_llm(make_llm, tiny_model, raw[n]) for n in raw}}
    for p, n, o in zip(prompts, names, got):
        assert o.token_ids == reference[n].generate([p], GREEDY)[0].token_ids, n
    # each adapter changes the tokens of the same prompt (the base's are checked above)
    outs = {n: llm.generate([prompts[0]], dataclasses.replace(GREEDY, lora=n))[0].token_ids for n in reference}
    assert len({tuple(v) for v in outs.values()}) == len(outs)


def test_embeddings_under_adapters_are_the_merged_models(make_llm, tiny_model, adapters):
    """Embeddings (mean and last token) under adapters, batched with the base model's: each the vector the model
    with that adapter merged into its weights gives; the adapters change them."""
    paths, raw = adapters
    llm = make_llm(lora=LoraConfig(max_loras=3, max_rank=8))
    for name, path in paths.items():
        llm.engine.load_lora(name, path)
    names = ["", "all4", "qvd8", "mlp"] * 2
    prompts = _prompts(llm.model_config.vocab_size, (5, 17, 30, 9, 40, 12, 3, 25), seed=4)
    pooled = [SamplingParams(max_tokens=0, pooling="mean" if i % 2 else "last", lora=n) for i, n in enumerate(names)]
    got = llm.generate(prompts, pooled)
    reference = {"": make_llm(), **{n: _merged_llm(make_llm, tiny_model, raw[n]) for n in raw}}
    for p, params, o in zip(prompts, pooled, got):
        want = reference[params.lora].generate([p], dataclasses.replace(params, lora=""))[0].embedding
        assert np.abs(o.embedding - want).max() < 1e-5 * np.abs(want).max(), params
        base = reference[""].generate([p], dataclasses.replace(params, lora=""))[0].embedding
        assert params.lora == "" or np.abs(o.embedding - base).max() > 1e-4, params


def test_more_adapters_than_slots_swap_in_and_wait(make_llm, tiny_model, adapters):
    """One slot, three adapters: requests for an adapter not resident wait for the slot (none fails),
    and each gets its merged model's tokens."""
    paths, raw = adapters
    llm = make_llm(lora=LoraConfig(max_loras=1, max_rank=8))
    for name, path in paths.items():
        llm.engine.load_lora(name, path)
    names = ["all4", "qvd8", "mlp", "all4", "mlp", "qvd8", ""]
    prompts = _prompts(llm.model_config.vocab_size, (6, 20, 11, 33, 8, 14, 9), seed=1)
    got = llm.generate(prompts, [dataclasses.replace(GREEDY, lora=n) for n in names])
    assert all(o.finish_reason == "length" for o in got)
    info = llm.engine.adapters.info()
    assert info["swaps"] >= 3 and info["running"] == [] and info["waiting"] == []
    reference = {n: _merged_llm(make_llm, tiny_model, raw[n]) for n in raw}
    reference[""] = make_llm()
    for p, n, o in zip(prompts, names, got):
        assert o.token_ids == reference[n].generate([p], GREEDY)[0].token_ids, n


def test_the_prefix_cache_keys_pages_by_adapter(make_llm, tiny_model, adapters):
    paths, raw = adapters
    llm = make_llm(lora=LoraConfig(max_loras=2, max_rank=8))
    llm.engine.load_lora("all4", paths["all4"])
    prompt = _prompts(llm.model_config.vocab_size, (48,), seed=2)[0]
    base = llm.generate([prompt], GREEDY)[0]
    under = llm.generate([prompt], dataclasses.replace(GREEDY, lora="all4"))[0]
    assert under.num_cached_tokens == 0  # the base model's pages are not the adapter's
    again = llm.generate([prompt], dataclasses.replace(GREEDY, lora="all4"))[0]
    assert again.num_cached_tokens > 0 and again.token_ids == under.token_ids
    assert under.token_ids == _merged_llm(make_llm, tiny_model, raw["all4"]).generate([prompt], GREEDY)[0].token_ids
    assert base.token_ids != under.token_ids
    # A new load under the same name is another adapter: its pages are its own too.
    llm.engine.unload_lora("all4")
    llm.engine.load_lora("all4", paths["mlp"])
    reloaded = llm.generate([prompt], dataclasses.replace(GREEDY, lora="all4"))[0]
    assert reloaded.num_cached_tokens == 0
    assert reloaded.token_ids == _merged_llm(make_llm, tiny_model, raw["mlp"]).generate([prompt], GREEDY)[0].token_ids


def test_an_adapter_loaded_in_place_serves_new_requests_while_the_old_one_finishes_its_own(make_llm, tiny_model,
                                                                                           adapters):
    """vLLM's load_inplace (an RL trainer's newest adapter under the same name): a request running on the old adapter
    finishes on it (its tokens the old merged model's), one made after the load runs the new one, no page of the
    old is shared with it, and the old one's slot is given back when its last request ends."""
    paths, raw = adapters
    llm = make_llm(lora=LoraConfig(max_loras=2, max_rank=8))
    e = llm.engine
    e.load_lora("tuned", paths["all4"])
    prompt = _prompts(llm.model_config.vocab_size, (48,), seed=4)[0]
    old = _merged_llm(make_llm, tiny_model, raw["all4"]).generate([prompt], GREEDY)[0].token_ids
    new = _merged_llm(make_llm, tiny_model, raw["mlp"]).generate([prompt], GREEDY)[0].token_ids
    assert old != new
    e.add_request(prompt, dataclasses.replace(GREEDY, lora="tuned"), request_id="before")
    tokens = {"before": [], "after": []}
    for _ in range(3):
        for ev in e.step():
            tokens[ev.request_id] += ev.token_ids
    e.load_lora("tuned", paths["mlp"], replace=True)
    e.add_request(prompt, dataclasses.replace(GREEDY, lora="tuned"), request_id="after")
    while e.has_work():
        for ev in e.step():
            tokens[ev.request_id] += ev.token_ids
    assert tokens == {"before": old, "after": new}
    assert e.adapters.names() == ["tuned"] and sum(s is not None for s in e.adapters.slots) == 1
    again = llm.generate([prompt], dataclasses.replace(GREEDY, lora="tuned"))[0]
    assert again.token_ids == new and again.num_cached_tokens > 0  # (the new one's own pages, cached)
    e.load_lora("tuned", paths["all4"], replace=True)  # (idle: the old one goes at once)
    assert llm.generate([prompt], dataclasses.replace(GREEDY, lora="tuned"))[0].num_cached_tokens == 0
    e.load_lora("fresh", paths["mlp"], replace=True)  # (nothing of that name: an ordinary load)
    assert sorted(e.adapters.names()) == ["fresh", "tuned"]


def test_unloading_waits_for_the_adapters_requests(make_llm, adapters):
    paths, _ = adapters
    llm = make_llm(lora=LoraConfig(max_loras=1, max_rank=8))
    e = llm.engine
    e.load_lora("all4", paths["all4"])
    with pytest.raises(InvalidRequest, match="already loaded"):
        e.load_lora("all4", paths["all4"])
    e.add_request([5, 6, 7, 8], dataclasses.replace(GREEDY, lora="all4"))
    e.step()
    assert e.unload_lora("all4") is False  # in use: it goes when the request ends
    with pytest.raises(NotFound, match="^lora: no LoRA adapter named 'all4'"):
        e.add_request([5, 6], dataclasses.replace(GREEDY, lora="all4"))
    with pytest.raises(InvalidRequest, match="is being unloaded: its running requests finish first"):
        e.load_lora("all4", paths["all4"])  # (not "already loaded": it is served no more)
    e.run_until_done()
    e.load_lora("all4", paths["all4"])  # once they have
    assert e.unload_lora("all4") is True
    assert e.adapters.names() == [] and e.adapters.slots == [None]
    with pytest.raises(NotFound, match=r"^lora: no LoRA adapter named 'nope' is loaded \(loaded: none\)"):
        llm.generate([[5, 6]], dataclasses.replace(GREEDY, lora="nope"))
    plain = make_llm()
    with pytest.raises(NotFound, match="^lora: .* serves none"):
        plain.generate([[5, 6]], dataclasses.replace(GREEDY, lora="all4"))
    with pytest.raises(InvalidRequest, match="lora_name: this server has no LoRA slots"):
        plain.engine.load_lora("all4", paths["all4"])


def test_bad_adapters_are_refused_naming_the_key(make_llm, tiny_model, tmp_path):
    from jaxcb.model.lora import read_adapter

    cfg = tiny_model[0]
    write_adapter(str(tmp_path / "big"), cfg, rank=16, seed=4)
    with pytest.raises(InvalidConfig, match="rank 16 is above lora.max_rank 8"):
        read_adapter(str(tmp_path / "big"), cfg, max_rank=8)
    write_adapter(str(tmp_path / "dora"), cfg, extra_config={"use_dora": True})
    with pytest.raises(InvalidConfig, match="use_dora"):
        read_adapter(str(tmp_path / "dora"), cfg)
    # PEFT settings that compute something else than plain LoRA, and patterns of the wrong shape (a 500 before):
    # refused naming the key
    for extra, message in (({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens"),
                           ({"layer_replication": [[0, 1], [0, 1]]}, "layer_replication"),
                           ({"use_bdlora": True}, "use_bdlora"), ({"lora_bias": True}, "lora_bias"),
                           ({"trainable_token_indices": [3]}, "trainable_token_indices"),
                           ({"kasa_config": {}}, None), ({"kasa_config": {"r": 4}}, "kasa_config"),
                           ({"init_lora_weights": "pissa_niter_4"}, "init_lora_weights = 'pissa_niter_4'"),
                           ({"init_lora_weights": "olora"}, "path_initial_model_for_weight_conversion"),
                           ({"alpha_pattern": ["q_proj"]}, "alpha_pattern must be an object"),
                           ({"alpha_pattern": {"q_proj(": 3}}, "alpha_pattern: 'q_proj\\(' is not a regular expression"),
                           ({"alpha_pattern": {"q_proj": "big"}}, "alpha_pattern must be an object"),
                           ({"rank_pattern": {"q_proj": None}}, "rank_pattern must be an object")):
        write_adapter(str(tmp_path / "odd"), cfg, extra_config=extra)
        if message is None:  # (empty: nothing asked)
            read_adapter(str(tmp_path / "odd"), cfg)
            continue
        with pytest.raises(InvalidConfig, match=message):
            read_adapter(str(tmp_path / "odd"), cfg)
    for plain in ({"init_lora_weights": True}, {"init_lora_weights": "gaussian"}, {"alora_invocation_tokens": None}):
        write_adapter(str(tmp_path / "odd"), cfg, extra_config=plain)
        read_adapter(str(tmp_path / "odd"), cfg)
    with pytest.raises(InvalidConfig, match="adapter_config.json"):
        read_adapter(str(tmp_path), cfg)
    from safetensors.numpy import save_file

    write_adapter(str(tmp_path / "embed"), cfg)
    save_file({"base_model.model.model.embed_tokens.lora_A.weight": np.zeros((4, 8), np.float32)},
              os.path.join(tmp_path / "embed", "adapter_model.safetensors"))
    with pytest.raises(InvalidConfig, match="embed_tokens.lora_A.weight is not a LoRA A/B weight"):
        read_adapter(str(tmp_path / "embed"), cfg)
    with pytest.raises(InvalidConfig, match="lora.max_loras"):
        LoraConfig(adapters=("a=/x",))
    with pytest.raises(InvalidConfig, match="lora.targets"):
        LoraConfig(max_loras=1, targets=("wq", "lm_head"))
    llm = make_llm(lora=LoraConfig(max_loras=1, targets=("wq",)))
    write_adapter(str(tmp_path / "v"), cfg, targets=("wv",))
    with pytest.raises(InvalidConfig, match="lora.targets"):
        llm.engine.load_lora("v", str(tmp_path / "v"))


def test_an_alpha_pattern_key_is_a_regex_taken_whole(tiny_model, tmp_path):
    """PEFT groups a pattern key (get_pattern_key: (.*\\.)?(key)$), so an alternation matches either module."""
    from jaxcb.model.lora import read_adapter

    cfg = tiny_model[0]
    scales = {}
    for name, pattern in (("alternation", {"q_proj|v_proj": 40.0}), ("spelt", {"q_proj": 40.0, "v_proj": 40.0})):
        write_adapter(str(tmp_path / name), cfg, targets=("wq", "wk", "wv"), alpha=8.0, extra_config={"alpha_pattern": pattern})
        adapter = read_adapter(str(tmp_path / name), cfg)
        scales[name] = {t: b for t, (_, b) in adapter.weights.items()}  # (B holds the scale)
    for t in ("wq", "wk", "wv"):
        np.testing.assert_array_equal(scales["alternation"][t], scales["spelt"][t])
    plain = read_adapter(str(tmp_path / "spelt"), cfg)  # (and the pattern matters: k keeps lora_alpha 8)
    write_adapter(str(tmp_path / "none"), cfg, targets=("wq", "wk", "wv"), alpha=8.0)
    base = read_adapter(str(tmp_path / "none"), cfg)
    np.testing.assert_allclose(plain.weights["wq"][1], base.weights["wq"][1] * 5.0, rtol=1e-6)
    np.testing.assert_array_equal(plain.weights["wk"][1], base.weights["wk"][1])


def test_an_adapter_applies_what_its_config_targets_as_peft_builds_it(tiny_model, tmp_path):
    """PEFT builds an adapter's layers from its config, not from the tensors in its file: a tensor for a module
    target_modules does not name (a list by names or their last parts, a string as a regular expression taken
    whole, "all-linear"), that exclude_modules names, or of a layer outside layers_to_transform is left out; a
    config without lora_alpha scales by PEFT's default 8 / r."""
    from jaxcb.model.lora import read_adapter

    cfg = tiny_model[0]
    raw = write_adapter(str(tmp_path / "all"), cfg, rank=2, alpha=6.0)
    whole = read_adapter(str(tmp_path / "all"), cfg)

    def adapted(extra):  # (the same tensors, another config)
        write_adapter(str(tmp_path / "one"), cfg, rank=2, alpha=6.0, extra_config=extra)
        return read_adapter(str(tmp_path / "one"), cfg).weights

    for extra, kept in (({"target_modules": ["q_proj", "v_proj"]}, {"wq", "wv"}),
                        ({"target_modules": ["self_attn.o_proj", "mlp.up_proj"]}, {"wo", "w_up"}),
                        ({"target_modules": r".*\.(gate|down)_proj"}, {"w_gate", "w_down"}),
                        ({"target_modules": "q_proj"}, set()),  # (a string matches the full name whole)
                        ({"target_modules": "all-linear"}, set(whole.weights)),
                        ({"target_modules": None, "target_parameters": ["self_attn.k_proj.weight"]}, {"wk"}),
                        ({"exclude_modules": ["k_proj", "mlp.up_proj"]}, set(whole.weights) - {"wk", "w_up"})):
        if not kept:
            with pytest.raises(InvalidConfig, match="holds no LoRA weights"):
                adapted(extra)
            continue
        weights = adapted(extra)
        assert set(weights) == kept, extra
        for t in kept:
            np.testing.assert_array_equal(weights[t][1], whole.weights[t][1])
    layers = adapted({"layers_to_transform": 1})
    assert all(not b[0].any() and b[1].any() for _, b in layers.values())  # (layer 0's tensors left out)
    named = adapted({"target_modules": ["model.layers.0.mlp.up_proj"]})  # (a full name: that layer's alone)
    assert set(named) == {"w_up"} and named["w_up"][1][0].any() and not named["w_up"][1][1].any()
    with open(tmp_path / "all" / "adapter_config.json") as f:
        config = json.load(f)
    del config["lora_alpha"]  # (no lora_alpha: PEFT's 8)
    with open(tmp_path / "all" / "adapter_config.json", "w") as f:
        json.dump(config, f)
    default = read_adapter(str(tmp_path / "all"), cfg).weights
    a, b, _ = raw[("wq", 0)]
    np.testing.assert_allclose(default["wq"][1][0], b.T * 8.0 / 2, rtol=1e-6)


def test_generate_runs_with_the_adapter_it_is_given(tiny_gguf_path, config_path, tiny_model, adapters, tmp_path, capsys):
    """jaxcb generate --lora NAME=PATH runs with it (it read the adapter and ran the base model); --adapter picks one
    of several, "" the base; an input line's own "lora" wins."""
    from jaxcb.cli import main as cli

    paths, _ = adapters
    args = ["generate", "--model", tiny_gguf_path, "--config", config_path, "--raw", "--max-tokens", "6", "--dtype",
            "float32"]
    lora = ["--lora", f"a={paths['all4']}"]
    texts = {}
    for key, extra in (("base", []), ("one", lora), ("picked", lora + ["--lora", f"b={paths['qvd8']}", "--adapter", "a"]),
                       ("plain", lora + ["--adapter", ""])):
        assert cli([*args, *extra, "hello there"]) == 0
        texts[key] = capsys.readouterr().out
    assert texts["one"] == texts["picked"] != texts["base"] == texts["plain"]
    lines = tmp_path / "in.jsonl"
    lines.write_text(json.dumps({"prompt": "hello there", "chat": False}) + "\n"
                     + json.dumps({"prompt": "hello there", "chat": False, "lora": ""}) + "\n")
    assert cli([*args, *lora, "--input", str(lines)]) == 0
    got = [json.loads(line)["text"] for line in capsys.readouterr().out.splitlines()]
    assert got == [texts["one"].rstrip("\n"), texts["base"].rstrip("\n")]


def test_merge_and_the_memory_plan(tiny_model, adapters):
    from jaxcb.host import memory_plan
    from jaxcb.host.engine_config import make_config
    from jaxcb.model.llama import params_to_weights
    from jaxcb.model.lora import merge, read_adapter

    cfg, params, _, _ = tiny_model
    paths, raw = adapters
    weights = {k: np.asarray(v) for k, v in params_to_weights(params).items()}
    ours = merge(weights, read_adapter(paths["qvd8"], cfg))
    theirs = merged_weights(weights, raw["qvd8"])
    for k in weights:
        np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-5, atol=1e-6)
    config = make_config(num_pages=0, max_context=256)
    base = memory_plan.plan_for_model(cfg, config, budget_bytes=64 << 20, dtype_bytes=4)
    lora = LoraConfig(max_loras=8, max_rank=16)
    with_slots = memory_plan.plan_for_model(cfg, config.replace(lora=lora), budget_bytes=64 << 20, dtype_bytes=4)
    shapes = cfg.weight_shapes()
    per_slot = sum((shapes[t][1] + shapes[t][2]) * 16 for t in lora.targets) * cfg.num_layers * 4
    assert with_slots.lora_bytes == 8 * per_slot
    assert with_slots.weight_bytes == base.weight_bytes + 8 * per_slot


def test_served_over_http_and_grpc(tiny_gguf_path, config_path, tiny_model, adapters):
    """`jaxcb serve --lora NAME=PATH`: vLLM's load/unload endpoints, /v1/models, the `model` field, gRPC's
    LoadLoraAdapter and GenerateRequest.lora, the endpoint picker's lora_requests_info metric."""
    import httpx

    from jaxcb.host.engine_config import load_config
    from jaxcb.llm import LLM
    from serve.client import Client
    import grpc

    from serve.proto import jaxcb_pb2, jetstream_pb2, jetstream_pb2_grpc
    from tests.server_util import ServerProcess, free_port

    paths, _ = adapters
    cfg, params, tok, eos = tiny_model
    offline = LLM.from_params(cfg, params, tok, eos_ids=eos, config=load_config(config_path).replace(
        lora=LoraConfig(max_loras=2, max_rank=8)))
    for name, path in paths.items():
        offline.engine.load_lora(name, path)
    prompt = [5, 6, 7, 8, 9, 10, 11]

    def expected(name):
        return offline.generate([prompt], dataclasses.replace(GREEDY, lora=name))[0].text

    http = free_port()
    server = ServerProcess(tiny_gguf_path, config_path, "--http-port", str(http), "--lora", f"all4={paths['all4']}",
                           "--max-loras", "2", "--max-lora-rank", "8")
    url = f"http://127.0.0.1:{http}"
    try:
        server.wait_serving()
        with httpx.Client(base_url=url, timeout=60) as h:
            base = h.get("/v1/models").json()["data"][0]["id"]
            r = h.post("/v1/load_lora_adapter", json={"lora_name": "qvd8", "lora_path": paths["qvd8"]})
            assert r.status_code == 200, r.text
            r = h.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/nonexistent"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
            models = {m["id"]: m for m in h.get("/v1/models").json()["data"]}
            assert set(models) == {base, "all4", "qvd8"} and models["qvd8"]["parent"] == base
            for name in ("all4", "qvd8", base):
                body = {"model": name, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
                answer = h.post("/v1/completions", json=body).json()
                assert answer["model"] == name
                assert answer["choices"][0]["text"] == expected("" if name == base else name), name
            missing = h.post("/v1/completions", json={"model": "nope", "prompt": prompt, "max_tokens": 2})
            assert missing.status_code == 404 and "qvd8" in missing.json()["error"]["message"]
            metrics = h.get("/metrics").text
            assert 'jaxcb:lora_requests_info{max_lora="2"' in metrics
            again = h.post("/v1/load_lora_adapter", json={"lora_name": "qvd8", "lora_path": paths["mlp"]})
            assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
            r = h.post("/v1/load_lora_adapter", json={"lora_name": "qvd8", "lora_path": paths["mlp"],
                                                      "load_inplace": True})  # (vLLM's: the newest under its name)
            assert r.status_code == 200, r.text
            body = {"model": "qvd8", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
            assert h.post("/v1/completions", json=body).json()["choices"][0]["text"] == expected("mlp")
            assert h.post("/v1/unload_lora_adapter", json={"lora_name": "qvd8"}).status_code == 200
            assert "qvd8" not in {m["id"] for m in h.get("/v1/models").json()["data"]}
        with Client(server.target) as c:
            c.stub.LoadLoraAdapter(jaxcb_pb2.LoadLoraAdapterRequest(lora_name="mlp", lora_path=paths["mlp"]))
            assert "mlp" in c.stub.GetModelInfo(jaxcb_pb2.GetModelInfoRequest()).lora_adapters
            assert c.complete(token_ids=prompt, max_tokens=16, ignore_eos=True, lora="mlp").text == expected("mlp")
            with grpc.insecure_channel(server.target) as ch:  # JetStream's Decode names it by lora_adapter_id
                got = [t for r in jetstream_pb2_grpc.OrchestratorStub(ch).Decode(jetstream_pb2.DecodeRequest(
                    max_tokens=16, lora_adapter_id="mlp", token_content=jetstream_pb2.DecodeRequest.TokenContent(
                        token_ids=prompt)), timeout=60) for t in r.stream_content.samples[0].token_ids]
            assert got == offline.generate([prompt], dataclasses.replace(GREEDY, lora="mlp", ignore_eos=False))[0].token_ids
            done = c.stub.UnloadLoraAdapter(jaxcb_pb2.UnloadLoraAdapterRequest(lora_name="mlp"))
            assert done.done
    finally:
        assert server.stop() == 0, server.output()


def test_each_token_loads_its_share_and_unloads_only_its_own(tiny_gguf_path, config_path, adapters):
    """With bearer tokens an adapter loaded while serving is its loader's: another token cannot unload it (403,
    gRPC's PERMISSION_DENIED), nor one of the command line's; each token loads at most its even share of
    lora.max_cpu_loras."""
    import grpc
    import httpx

    from serve.client import Client
    from serve.proto import jaxcb_pb2
    from tests.server_util import ServerProcess, free_port

    paths, _ = adapters
    http = free_port()
    server = ServerProcess(tiny_gguf_path, config_path, "--http-port", str(http), "--lora", f"all4={paths['all4']}",
                           "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "4",
                           "--auth-token", "alice", "--auth-token", "bob")
    try:
        server.wait_serving(metadata=(("authorization", "Bearer alice"),))
        alice = httpx.Client(base_url=f"http://127.0.0.1:{http}", timeout=60, headers={"authorization": "Bearer alice"})
        bob = httpx.Client(base_url=f"http://127.0.0.1:{http}", timeout=60, headers={"authorization": "Bearer bob"})
        for name in ("qvd8", "mlp"):
            assert alice.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": paths[name]}).status_code == 200
        r = alice.post("/v1/load_lora_adapter", json={"lora_name": "third", "lora_path": paths["mlp"]})
        assert r.status_code == 400 and "its share of lora.max_cpu_loras (4 among 2 tokens)" in r.text
        for name, who in (("qvd8", "another token"), ("all4", "the server's command line")):
            r = bob.post("/v1/unload_lora_adapter", json={"lora_name": name})
            assert r.status_code == 403 and r.json()["error"]["message"] == (
                f"lora_name: the adapter {name!r} was loaded by {who}; only its loader unloads it"), r.text
        with Client(server.target, token="bob") as c, pytest.raises(grpc.RpcError) as e:
            c.stub.UnloadLoraAdapter(jaxcb_pb2.UnloadLoraAdapterRequest(lora_name="mlp"), metadata=c.metadata)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert bob.post("/v1/completions", json={"model": "qvd8", "prompt": [5, 6], "max_tokens": 2}).status_code == 200
        assert alice.post("/v1/unload_lora_adapter", json={"lora_name": "qvd8"}).status_code == 200
        assert bob.post("/v1/load_lora_adapter", json={"lora_name": "qvd8", "lora_path": paths["qvd8"]}).status_code == 200
        r = bob.post("/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": paths["qvd8"], "load_inplace": True})
        assert r.status_code == 403 and "only its loader replaces it" in r.text  # (alice's adapter)
        # Loads side by side are counted one after another: bob (one loaded) gets his share's one more, no more.
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            codes = list(pool.map(lambda i: bob.post("/v1/load_lora_adapter", json={
                "lora_name": f"b{i}", "lora_path": paths["mlp"]}).status_code, range(5)))
        assert codes.count(200) == 1 and codes.count(400) == 4, codes
    finally:
        assert server.stop() == 0, server.output()


def test_convert_merges_an_adapter(tiny_gguf_path, tiny_model, adapters, tmp_path):
    from jaxcb.cli import main as cli
    from jaxcb.llm import load_model
    from jaxcb.model.llama import params_to_weights

    paths, raw = adapters
    out = str(tmp_path / "merged")
    assert cli(["convert", tiny_gguf_path, out, "--dtype", "float32", "--lora", paths["qvd8"]]) == 0
    _, params, _, _ = load_model(out)
    weights = {k: np.asarray(v) for k, v in params_to_weights(tiny_model[1]).items()}
    want = merged_weights(weights, raw["qvd8"])
    for k, v in params_to_weights(params).items():
        np.testing.assert_allclose(np.asarray(v), want[k], rtol=1e-5, atol=1e-6)
