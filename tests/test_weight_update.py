"""New weights while serving (jaxcb.weight_update; the RL trainer's weight sync): the tokens after an update are an
engine's built with the new weights, running requests go on from their tokens on them, nothing compiles again, and
generation pauses in vLLM's three modes. The HTTP routes are tested in tests/test_openai_api.py."""

import collections
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxcb import weight_update
from jaxcb.device.runner import compilation_count
from jaxcb.host.errors import InvalidRequest
from jaxcb.host.request import FinishReason, SamplingParams
from jaxcb.model.llama import params_from_numpy, random_weights
from tests.test_model_dirs import write_hf_dir
from tests.tiny_gguf import tiny_model_config, write_tiny_gguf

PROMPTS = [[5, 9, 40, 41, 7], list(range(3, 40)), [11, 12, 13]]


def greedy(llm, prompts=PROMPTS, max_tokens=10):
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))]


def built_with(make_llm, tiny_model, weights):
    config, _, tokenizer, eos = tiny_model
    return make_llm(model=(config, params_from_numpy(weights), tokenizer, eos))


def test_new_weights_give_the_tokens_of_an_engine_built_with_them(make_llm, tiny_model, tiny_gguf_path):
    new = random_weights(tiny_model[0], seed=1)
    expected = greedy(built_with(make_llm, tiny_model, new))
    llm = make_llm()
    before = greedy(llm)
    compiled = compilation_count()
    llm.update_weights(new, version="step-1")
    after = greedy(llm)
    assert compilation_count() == compiled  # the same arrays' shapes: every program is the one compiled before
    assert after != before and llm.weight_version == "step-1"
    assert after == expected
    llm.update_weights(tiny_gguf_path)  # the file it was loaded from: its tokens again
    assert greedy(llm) == before and llm.weight_version is None
    assert compilation_count() == compiled


def test_a_hugging_face_checkpoint_or_state_dict_gives_the_weights_it_holds(make_llm, tiny_model, tmp_path):
    """By path (a Hugging Face directory) or as arrays by their Hugging Face names, the served arrays are those of the
    same weights given in jaxcb's own layout."""
    config, _, tokenizer, _ = tiny_model
    new = random_weights(config, seed=2)
    write_hf_dir(str(tmp_path), config, new, tokenizer)
    llm = make_llm()
    llm.update_weights(new)
    expected, tokens = llm.weight_checksums(), greedy(llm)
    llm.update_weights(tiny_model[1])  # (Params themselves: the loaded ones)
    assert llm.weight_checksums() != expected
    llm.update_weights(str(tmp_path))
    assert llm.weight_checksums() == expected
    llm.update_weights(tiny_model[1])
    state = {}
    for f in sorted(os.listdir(tmp_path)):
        if f.endswith(".safetensors"):
            state.update(load_file(str(tmp_path / f)))
    llm.update_weights(state)
    assert llm.weight_checksums() == expected and greedy(llm) == tokens


def test_requests_running_at_the_update_go_on_from_their_tokens_on_the_new_weights(make_llm, tiny_model):
    """The step in flight finishes on the old weights; then each running request is computed again from its prompt
    and the tokens it has, on the new ones: what follows is what an engine built with them continues with."""
    max_tokens = 24
    unchanged = greedy(make_llm(), PROMPTS, max_tokens)
    llm = make_llm()
    engine = llm.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id=f"r{i}")
    tokens = collections.defaultdict(list)
    while min((len(tokens[f"r{i}"]) for i in range(len(PROMPTS))), default=0) < 4:
        for ev in engine.step():
            tokens[ev.request_id] += ev.token_ids
    new = random_weights(tiny_model[0], seed=1)
    (done,) = weight_update.update([engine], new, "v1")
    old = None
    while engine.has_work():
        for ev in engine.step():
            tokens[ev.request_id] += ev.token_ids
        if old is None and done.done():
            old = {rid: len(t) for rid, t in tokens.items()}  # (what the steps finished before it made)
    assert done.result() == "v1" and engine.stats().preemptions == 0  # (computed again: not out of pages)
    fresh = built_with(make_llm, tiny_model, new)
    for i, p in enumerate(PROMPTS):
        rid = f"r{i}"
        k = old[rid]
        assert 4 <= k < max_tokens and len(tokens[rid]) == max_tokens
        assert tokens[rid][:k] == unchanged[i][:k]
        assert tokens[rid][k:] == greedy(fresh, [p + tokens[rid][:k]], max_tokens - k)[0]
    assert [tokens[f"r{i}"] for i in range(len(PROMPTS))] != unchanged


def test_an_update_forgets_the_prefix_cache(make_llm, tiny_model):
    llm = make_llm()
    prompt = list(range(3, 75))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    llm.generate([prompt], params)
    assert llm.generate([prompt], params)[0].num_cached_tokens >= 64
    new = random_weights(tiny_model[0], seed=1)
    llm.update_weights(new)
    out = llm.generate([prompt], params)[0]
    assert out.num_cached_tokens == 0
    assert out.token_ids == built_with(make_llm, tiny_model, new).generate([prompt], params)[0].token_ids


def run(engine, tokens, finished):
    for ev in engine.step():
        tokens[ev.request_id] += ev.token_ids
        if ev.finished:
            finished[ev.request_id] = ev.finish_reason


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_a_pause_holds_new_requests_and_treats_running_ones_as_its_mode_says(make_llm, mode):
    """abort: every request ends; wait: the running ones finish; keep: they freeze where they are and go on at
    resume. In every mode a request that arrives while paused waits, unstarted, and runs after resume; the tokens
    of every request that completes are those of an engine never paused."""
    llm = make_llm()
    expected = greedy(llm, PROMPTS[:2], 16)
    engine = llm.engine
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    engine.add_request(PROMPTS[0], params, request_id="running")
    tokens, finished = collections.defaultdict(list), {}
    while len(tokens["running"]) < 3:
        run(engine, tokens, finished)
    paused = engine.pause(mode)
    engine.add_request(PROMPTS[1], params, request_id="arrived")
    for _ in range(40):
        if not engine.has_work():
            break
        run(engine, tokens, finished)
    assert not engine.has_work() and paused.result(timeout=0) is True and engine.paused == mode
    assert tokens["arrived"] == [] and "arrived" not in finished
    held = len(tokens["running"])
    if mode == "abort":
        assert finished["running"] == FinishReason.ABORT and held < 16
    elif mode == "wait":
        assert finished["running"] == FinishReason.LENGTH and tokens["running"] == expected[0]
    else:
        assert "running" not in finished and held < 16
        run(engine, tokens, finished)  # (nothing moves while paused)
        assert len(tokens["running"]) == held
    resumed = engine.resume()
    while engine.has_work():
        run(engine, tokens, finished)
    assert resumed.result(timeout=0) is True and engine.paused is None
    assert finished["arrived"] == FinishReason.LENGTH and tokens["arrived"] == expected[1]
    if mode == "keep":
        assert finished["running"] == FinishReason.LENGTH and tokens["running"] == expected[0]
    with pytest.raises(InvalidRequest, match="mode"):
        engine.pause("sleep")


def test_weights_of_another_model_are_refused_and_the_served_ones_go_on(make_llm, tiny_model, tmp_path):
    config = tiny_model[0]
    llm = make_llm()
    before = greedy(llm)
    deeper = str(tmp_path / "deeper.gguf")
    write_tiny_gguf(deeper, tiny_model_config(num_layers=config.num_layers + 1))
    with pytest.raises(InvalidRequest, match="num_layers"):
        llm.update_weights(deeper)
    with pytest.raises(InvalidRequest, match="does not exist"):
        llm.update_weights(str(tmp_path / "absent.gguf"))
    new = random_weights(config, seed=1)
    with pytest.raises(InvalidRequest, match="wq"):
        llm.update_weights({k: v for k, v in new.items() if k != "wq"})
    with pytest.raises(InvalidRequest, match="w_up"):
        llm.update_weights({**new, "w_up": np.swapaxes(new["w_up"], 1, 2)})
    state = {"model.embed_tokens.weight": new["embed"], "model.norm.weight": new["final_norm"], "rogue.weight": new["embed"]}
    with pytest.raises(InvalidRequest, match="missing"):
        llm.update_weights(state)
    with pytest.raises(InvalidRequest, match="weight_version"):
        llm.update_weights(new, version="v" * 300)
    assert greedy(llm) == before and llm.weight_version is None


def device_bytes() -> int:
    import jax

    return sum(a.nbytes for a in jax.live_arrays())


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_devices_memory_and_wake_up_brings_the_engine_back(make_llm, tiny_model, level):
    """vLLM's sleep mode: once still, the KV pages and the weights leave the devices (level 1 keeps the weights on
    the host; level 2 drops them, new ones coming by update_weights); a request it kept ("keep") and one that
    arrives while asleep run after wake_up, with the tokens of an engine that never slept; nothing compiles."""
    import jax

    llm = make_llm()
    llm.warmup()
    expected = greedy(llm, PROMPTS[:2], 16)
    engine = llm.engine
    kv = sum(a.nbytes for a in engine.runner.kv_arrays)
    loaded = {id(a) for a in jax.tree.leaves(tiny_model[1])}  # (arrays the session's fixture holds too stay)
    weights = sum(a.nbytes for a in jax.tree.leaves(engine.runner.params) if id(a) not in loaded)
    compiled = compilation_count()
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    engine.add_request(PROMPTS[0], params, request_id="kept")
    tokens, finished = collections.defaultdict(list), {}
    while len(tokens["kept"]) < 3:
        run(engine, tokens, finished)
    held = device_bytes()
    asleep = engine.sleep(level, "keep")
    while engine.has_work():
        run(engine, tokens, finished)
    assert asleep.result(timeout=0) is True and engine.asleep == {"weights", "kv_cache"}
    assert held - device_bytes() >= kv + weights > kv  # (the pages' and the weights' arrays are gone)
    engine.add_request(PROMPTS[1], params, request_id="arrived")
    for _ in range(3):
        run(engine, tokens, finished)
    assert not engine.has_work() and "kept" not in finished and tokens["arrived"] == []
    if level == 2:  # the weights were dropped: new ones (here the same) come as an update, then the pages
        llm.update_weights(tiny_model[1])
        compiled = compilation_count()  # (the update's own conversions may compile; the steps after it do not)
        assert engine.asleep == {"kv_cache"}
        awake = engine.wake_up(["kv_cache"])
    else:
        awake = engine.wake_up()
    while engine.has_work():
        run(engine, tokens, finished)
    assert awake.result(timeout=0) is True and not engine.asleep and engine.paused is None
    assert [tokens["kept"], tokens["arrived"]] == expected
    assert finished == {"kept": FinishReason.LENGTH, "arrived": FinishReason.LENGTH}
    assert greedy(llm, PROMPTS[:2], 16) == expected and compilation_count() == compiled
    with pytest.raises(InvalidRequest, match="level"):
        engine.sleep(3)
    with pytest.raises(InvalidRequest, match="tags"):
        engine.wake_up(["everything"])


def test_a_callers_jax_arrays_are_copied_never_served_or_freed(make_llm, tiny_model):
    """A trainer's arrays (a state dict of JAX arrays, or Params) stay the trainer's: none is freed by the update, and
    the engine serves copies (the trainer may donate or delete its own, as a training step does)."""
    import jax
    import jax.numpy as jnp

    new = random_weights(tiny_model[0], seed=1)
    expected = greedy(built_with(make_llm, tiny_model, new))
    llm = make_llm()
    mine = {k: jnp.asarray(v) for k, v in new.items()}
    llm.update_weights(mine)
    assert not any(a.is_deleted() for a in mine.values())
    for a in mine.values():
        a.delete()
    assert greedy(llm) == expected
    given = params_from_numpy(new)
    llm.update_weights(given)
    for a in jax.tree.leaves(given):
        a.delete()
    assert greedy(llm) == expected


def test_a_draft_cut_from_the_target_takes_the_new_weights_too(make_llm, tiny_model):
    """Speculative decoding with a draft made of the target's own layers: after an update it proposes from the new
    weights (all of them here: every proposal is accepted), and the tokens are the new weights' own."""
    from jaxcb.host.speculative import SpeculativeConfig

    config = tiny_model[0]
    new = random_weights(config, seed=1)
    expected = greedy(built_with(make_llm, tiny_model, new))
    llm = make_llm(speculative=SpeculativeConfig("draft", num_tokens=3, draft_layers=config.num_layers,
                                                 adaptive=False))
    llm.update_weights(new)
    stats = llm.engine.stats()
    assert greedy(llm) == expected
    after = llm.engine.stats()
    proposed = after.speculative_proposed - stats.speculative_proposed
    assert proposed > 0 and after.speculative_accepted - stats.speculative_accepted == proposed


@pytest.mark.parametrize("weights", ["int8", "int4", "bfloat16"])
def test_weights_given_loaded_take_updates_in_their_own_format(make_llm, tiny_model, tiny_gguf_path, weights):
    """LLM.from_params serves the arrays given as they are: new weights come in their format (quantized as they
    were), whatever the config's weights mode says; the same file's weights give the same tokens."""
    import jax.numpy as jnp

    from jaxcb.llm import load_model

    _, params, tokenizer, eos = load_model(tiny_gguf_path, jnp.float32, weights=weights)
    llm = make_llm(model=(tiny_model[0], params, tokenizer, eos), weights=weights)
    before = greedy(llm)
    llm.update_weights(random_weights(tiny_model[0], seed=1))
    assert greedy(llm) != before
    llm.update_weights(tiny_gguf_path)
    assert greedy(llm) == before
    plain = make_llm(weights=weights)  # (the float arrays given, the config's mode notwithstanding)
    plain.update_weights(tiny_gguf_path)


def test_a_second_pause_keeps_the_stricter_mode(make_llm):
    """A request frozen by "keep" stays frozen when a "wait" pause follows (it does not run to its end)."""
    llm = make_llm()
    engine = llm.engine
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=16, ignore_eos=True), request_id="kept")
    tokens, finished = collections.defaultdict(list), {}
    while len(tokens["kept"]) < 3:
        run(engine, tokens, finished)
    kept, waited = engine.pause("keep"), engine.pause("wait")
    for _ in range(6):
        run(engine, tokens, finished)
    held = len(tokens["kept"])
    for _ in range(6):
        run(engine, tokens, finished)
    assert kept.result(timeout=0) and waited.result(timeout=0) and engine.paused == "keep"
    assert len(tokens["kept"]) == held < 16 and not finished
    engine.resume()
    while engine.has_work():
        run(engine, tokens, finished)
    assert finished == {"kept": FinishReason.LENGTH} and len(tokens["kept"]) == 16


def test_a_wake_up_before_the_sleep_settles_cancels_it(make_llm):
    """A sleep that waits for its running request, woken before it settles, never frees anything: the request and
    one after it run, the sleep is told it did not happen."""
    llm = make_llm()
    engine = llm.engine
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    engine.add_request(PROMPTS[0], params, request_id="a")
    tokens, finished = collections.defaultdict(list), {}
    run(engine, tokens, finished)
    asleep, awake = engine.sleep(1, "wait"), engine.wake_up()
    engine.add_request(PROMPTS[1], params, request_id="b")
    while engine.has_work():
        run(engine, tokens, finished)
    assert asleep.result(timeout=0) is False and awake.result(timeout=0) is True
    assert not engine.asleep and engine.paused is None and finished == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH}


def test_a_wait_pause_while_asleep_settles_and_a_deeper_sleep_drops_the_host_copy(make_llm, tiny_model):
    """Asleep, a "wait" pause has nothing to wait for (it settles); the weight checker refuses weights that are not
    there; a level-2 sleep after a level-1 one drops the host copy too; new weights and a wake bring the kept
    request back to its tokens."""
    llm = make_llm()
    engine = llm.engine
    expected = greedy(llm, PROMPTS[:1], 12)
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=12, ignore_eos=True), request_id="kept")
    tokens, finished = collections.defaultdict(list), {}
    run(engine, tokens, finished)
    engine.sleep(1, "keep")
    while engine.has_work():
        run(engine, tokens, finished)
    engine.resume()
    waiting = engine.pause("wait")
    for _ in range(3):
        run(engine, tokens, finished)
    assert waiting.result(timeout=0) is True and not engine.has_work()
    with pytest.raises(InvalidRequest, match="asleep"):
        weight_update.checksums(engine)
    deeper = engine.sleep(2, "keep")
    run(engine, tokens, finished)
    assert deeper.result(timeout=0) is True and engine.runner._host_params is None
    llm.update_weights(tiny_model[1])
    engine.wake_up()
    while engine.has_work():
        run(engine, tokens, finished)
    assert tokens["kept"] == expected[0] and finished == {"kept": FinishReason.LENGTH}


def test_a_wake_up_where_the_runner_cannot_sleep_resumes_without_failing(make_llm):
    """A multi-host leader's runner has no sleep (levels 1 and 2 are refused there); a level-0 sleep and the wake_up
    vLLM's clients send after it still go through."""
    llm = make_llm()
    runner = llm.engine.runner

    class NoSleep:  # (the runner as a multi-host leader wraps it: no release, restore or asleep)
        def __getattr__(self, name):
            if name in ("release", "restore", "asleep"):
                raise AttributeError(name)
            return getattr(runner, name)

    llm.engine.runner = NoSleep()
    with pytest.raises(InvalidRequest, match="level"):
        llm.engine.sleep(1)
    paused, awake = llm.engine.sleep(0), llm.engine.wake_up(["scheduling"])
    llm.engine.step()
    assert paused.result(timeout=0) is False and awake.result(timeout=0) is True and llm.engine.paused is None
    llm.engine.runner = runner


def test_adapters_apply_to_the_new_base_weights(make_llm, tiny_model, tmp_path):
    """A LoRA adapter served across an update is the same delta on the new base: its tokens are those of the new
    weights with the adapter merged into them."""
    from jaxcb.host.lora import LoraConfig
    from tests.lora_util import merged_weights, write_adapter

    config = tiny_model[0]
    raw = write_adapter(str(tmp_path / "adapter"), config, rank=4, seed=5)
    new = random_weights(config, seed=1)
    llm = make_llm(lora=LoraConfig(max_loras=1, max_rank=4))
    llm.engine.load_lora("tuned", str(tmp_path / "adapter"))
    params = SamplingParams(max_tokens=10, ignore_eos=True, lora="tuned")
    before = [o.token_ids for o in llm.generate(PROMPTS, params)]
    llm.update_weights(new)
    after = [o.token_ids for o in llm.generate(PROMPTS, params)]
    merged = built_with(make_llm, tiny_model, merged_weights(new, raw))
    assert after == greedy(merged) and after != before
    assert after != greedy(llm, PROMPTS, 10)  # (the adapter still changes the new base's tokens)


def test_the_kv_pages_alone_are_released_from_a_still_engine(make_llm):
    """vLLM's release_kv_cache_memory: refused unless paused with no request left; then the KV pages leave the
    devices, the weights stay; a request made meanwhile runs once they are back, with its own tokens."""
    llm = make_llm()
    expected = greedy(llm, PROMPTS[:1], 8)
    engine = llm.engine
    refused = engine.release_kv_cache()
    engine.step()
    with pytest.raises(InvalidRequest, match="pause first"):
        refused.result(timeout=0)
    paused = engine.pause("abort")
    engine.step()
    released = engine.release_kv_cache()
    engine.step()
    assert paused.result(timeout=0) and released.result(timeout=0) is True and engine.asleep == {"kv_cache"}
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True), request_id="later")
    tokens, finished = collections.defaultdict(list), {}
    run(engine, tokens, finished)
    assert not engine.has_work() and not tokens["later"]
    engine.wake_up(["kv_cache"])
    while engine.has_work():
        run(engine, tokens, finished)
    assert tokens["later"] == expected[0] and not engine.asleep


def test_weights_that_are_not_finite_are_refused(make_llm, tiny_model):
    """A NaN or an infinity anywhere would make every token garbage and its logprobs no number JSON writes: such
    weights are refused naming the array, and the served ones go on."""
    llm = make_llm()
    before = greedy(llm)
    for bad in (np.nan, np.inf):
        weights = random_weights(tiny_model[0], seed=1)
        weights["w_up"][1, 3, 5] = bad
        with pytest.raises(InvalidRequest, match="w_up holds values that are not finite"):
            llm.update_weights(weights)
    assert greedy(llm) == before
