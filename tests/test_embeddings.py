"""Embeddings (jaxcb.host.embedding): a prompt's last hidden states pooled, run by the engine beside generation.

The reference is transformers' own: the tiny Qwen3 and Gemma 3 checkpoints' last_hidden_state (after the final
norm; tools/make_tiny_hf.py --hidden wrote them), pooled by the last token or the mean over the prompt."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from jaxcb.host.embedding import Pooling, encoded
from jaxcb.host.engine_config import make_config
from jaxcb.host.errors import InvalidConfig, InvalidRequest
from jaxcb.host.request import SamplingParams
from jaxcb.llm import LLM, load_model
from tests.server_util import compile_mode

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "tiny_hf")


def hidden_records(family):
    with open(os.path.join(GOLDEN, family, "golden_hidden.json")) as f:
        return [(r["prompt_ids"], np.asarray(r["hidden"], np.float32)) for r in json.load(f)["records"]]


def tiny_llm(family, **config):
    model_config, params, tok, _ = load_model(os.path.join(GOLDEN, family), jnp.float32)
    settings = dict(num_pages=64, page_size=16, max_context=128, decode_batch=(4,), prefill_tokens=(16,),
                    max_prefill_tokens=16, compile=compile_mode(model_config))
    return LLM.from_params(model_config, params, tok, config=make_config(**{**settings, **config}))


def close(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / max(1e-6, float(np.abs(b).max())))


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_pooled_hidden_states_are_the_references(family):
    """Every prompt pooled both ways, in 16-token chunks (the 40-token prompt in three; Gemma 3's sliding
    window of 8 far behind), batched with requests that generate: each vector within 1e-5 of transformers'
    last_hidden_state pooled. Run again: the last-token requests take their full pages from the prefix
    cache (the last token is computed all the same), the mean ones compute every position again."""
    llm = tiny_llm(family)
    records = hidden_records(family)
    prompts = [ids for ids, _ in records]
    generate = SamplingParams(max_tokens=8, ignore_eos=True)
    for round in range(2):
        outs = llm.generate(prompts * 3, [SamplingParams(max_tokens=0, pooling="last")] * len(prompts)
                            + [SamplingParams(max_tokens=0, pooling="mean")] * len(prompts) + [generate] * len(prompts))
        for k, (ids, hidden) in enumerate(records):
            last, mean, gen = outs[k], outs[len(prompts) + k], outs[2 * len(prompts) + k]
            assert close(last.embedding, hidden[-1]) < 1e-5, (family, len(ids), close(last.embedding, hidden[-1]))
            assert close(mean.embedding, hidden.mean(0)) < 1e-5, (family, len(ids))
            assert last.token_ids == [] and mean.token_ids == [] and gen.embedding is None and len(gen.token_ids) == 8
            if round == 1:
                assert mean.num_cached_tokens == 0
                assert last.num_cached_tokens == (len(ids) - 1) // 16 * 16
    llm.engine.pool.check_all_free()
    if llm.model_config.windowed:
        llm.engine.window_group.pool.check_all_free()


def test_embeddings_beside_speculating_requests():
    """n-gram speculation on: steps that verify proposals carry embeddings' prompt chunks too; every vector is
    still the reference's."""
    from jaxcb.host.speculative import SpeculativeConfig

    llm = tiny_llm("qwen3", speculative=SpeculativeConfig("ngram", adaptive=False))
    records = hidden_records("qwen3")
    repeat = [7, 8, 9, 10] * 6  # (a prompt whose continuation n-grams propose)
    outs = llm.generate([repeat] * 2 + [ids for ids, _ in records] * 2,
                        [SamplingParams(max_tokens=24, ignore_eos=True)] * 2
                        + [SamplingParams(max_tokens=0, pooling=m) for m in ("last",) * 3 + ("mean",) * 3])
    assert llm.engine.stats().speculative_steps > 0
    for k, out in enumerate(outs[2:]):
        hidden = records[k % 3][1]
        want = hidden[-1] if k < 3 else hidden.mean(0)
        assert close(out.embedding, want) < 1e-5, k
    llm.engine.pool.check_all_free()


def test_preempted_embeddings_pool_every_position_once():
    """A pool too small for the batch: generating requests' growth takes the pages of embeddings part way
    through their prompts, which are recomputed; each mean still counts every prompt position once (its sum
    starts again), and every vector is the reference's."""
    llm = tiny_llm("qwen3", num_pages=8, decode_batch=(8,))
    records = hidden_records("qwen3")
    lost = []  # (pooling, prompt positions pooled) of each request preempted
    preempt = llm.engine.scheduler.preempt

    def watched(victim, *args, **kwargs):
        lost.append((victim.params.pooling, victim.pooled_upto))
        return preempt(victim, *args, **kwargs)

    llm.engine.scheduler.preempt = watched
    prompts = [ids for ids, _ in records] * 4
    params = [SamplingParams(max_tokens=0, pooling="mean" if i % 2 else "last") for i in range(len(prompts))]
    outs = llm.generate([records[2][0]] * 4 + prompts, [SamplingParams(max_tokens=60, ignore_eos=True)] * 4 + params)
    assert any(pooling == "mean" and upto > 0 for pooling, upto in lost), lost
    for i, out in enumerate(outs[4:]):
        hidden = records[i % 3][1]
        want = hidden.mean(0) if i % 2 else hidden[-1]
        assert close(out.embedding, want) < 1e-5, (i, close(out.embedding, want))
    llm.engine.pool.check_all_free()


def test_embed_normalizes_and_cuts_to_dimensions():
    """LLM.embed: the model's pooling (default: the last token, L2-normalized), `dimensions` the first
    values normalized again; a pooling and a size out of range are refused by name before anything runs."""
    llm = tiny_llm("qwen3")
    ids, hidden = hidden_records("qwen3")[1]
    whole, = llm.embed([ids])
    assert whole.shape == (64,) and abs(float(np.linalg.norm(whole)) - 1) < 1e-6
    assert close(whole, hidden[-1] / np.linalg.norm(hidden[-1])) < 1e-5
    cut, = llm.embed([ids], dimensions=16)
    assert close(cut, hidden[-1][:16] / np.linalg.norm(hidden[-1][:16])) < 1e-5
    with pytest.raises(InvalidRequest, match="dimensions: must be an integer between 1 and 64"):
        llm.embed([ids], dimensions=65)
    with pytest.raises(InvalidRequest, match="pooling: must be 'last' or 'mean'"):
        SamplingParams(max_tokens=0, pooling="cls")
    with pytest.raises(InvalidRequest, match="max_tokens: must be 0 for an embedding"):
        SamplingParams(max_tokens=4, pooling="last")
    with pytest.raises(InvalidRequest, match="n: must be 1"):
        SamplingParams(max_tokens=0, pooling="last", n=2)
    assert encoded(np.array([1.5, -2.0], np.float32), "float") == [1.5, -2.0]
    assert np.frombuffer(__import__("base64").b64decode(encoded(np.array([1.5, -2.0], np.float32), "base64")),
                         "<f4").tolist() == [1.5, -2.0]


def _st_dir(tmp_path, modules, pooling_config=None):
    path = tmp_path / "st"
    path.mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps(
        [{"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{t}"} for i, (t, p) in
         enumerate(modules)]))
    if pooling_config is not None:
        (path / "1_Pooling").mkdir(exist_ok=True)
        (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    return str(path)


def test_the_models_pooling_is_read_from_sentence_transformers_files(tmp_path):
    """modules.json and 1_Pooling/config.json as sentence-transformers writes them: the mode, whether a
    Normalize module follows; modes and modules this server does not run make the model refuse embeddings
    (naming why), not fail to load; a broken file is a configuration error."""
    base = [("Transformer", ""), ("Pooling", "1_Pooling")]
    mean = {"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False, "include_prompt": True}
    assert Pooling.from_dir(str(tmp_path)) == Pooling()  # none: the last token, normalized
    p = Pooling.from_dir(_st_dir(tmp_path, base + [("Normalize", "2_Normalize")], mean))
    assert (p.mode, p.normalize, p.unsupported) == ("mean", True, "")
    p = Pooling.from_dir(_st_dir(tmp_path, base, {"pooling_mode_lasttoken": True}))
    assert (p.mode, p.normalize, p.unsupported) == ("last", False, "")
    for modules, config, why in [
            (base + [("Dense", "2_Dense")], mean, "sentence_transformers.models.Dense"),
            (base, {"pooling_mode_cls_token": True}, "pooling_mode_cls_token"),
            (base, {**mean, "include_prompt": False}, "include_prompt false"),
            (base, {"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": True}, "several pooling modes")]:
        p = Pooling.from_dir(_st_dir(tmp_path, modules, config))
        assert why in p.unsupported
        with pytest.raises(InvalidRequest, match="model: does not give embeddings here: .*" + why):
            p.check(64, None)
    (tmp_path / "st" / "modules.json").write_text("[{")
    with pytest.raises(InvalidConfig, match="modules.json is not readable JSON"):
        Pooling.from_dir(str(tmp_path / "st"))
    saved = tmp_path / "saved"
    saved.mkdir()
    Pooling("mean", True, "x").save(str(saved))
    again = Pooling.from_dir(str(saved))
    assert (again.mode, again.normalize, again.unsupported) == ("mean", True, "")


def test_a_ggufs_pooling_type_and_add_eos(tmp_path):
    """A GGUF's {arch}.pooling_type (llama.cpp's: 1 mean, 3 last; 2 cls refused by name) is the model's pooling,
    kept by `jaxcb convert` (Tokenizer.save); tokenizer.ggml.add_eos_token ends an input to embed with the EOS."""
    from jaxcb.host.tokenizer import Tokenizer
    from jaxcb.model.gguf_loader import load_gguf
    from tests.tiny_gguf import write_tiny_gguf

    path = str(tmp_path / "mean.gguf")
    write_tiny_gguf(path, extra_uint32={"llama.pooling_type": 1})
    llm = LLM(path, config=make_config(num_pages=32, max_context=64, decode_batch=(2,), prefill_tokens=(32,),
                                       compile="fast"))
    assert (llm.pooling.mode, llm.pooling.normalize) == ("mean", True)
    ids = llm.tokenizer.encode_input("hello world")
    assert ids == llm.tokenizer.encode("hello world")  # (no post-processor, no add_eos)
    raw, = llm.generate([ids], SamplingParams(max_tokens=0, pooling="mean"))
    vector, = llm.embed(["hello world"])
    assert close(vector, raw.embedding / np.linalg.norm(raw.embedding)) < 1e-6
    out = tmp_path / "converted"
    out.mkdir()
    llm.tokenizer.save(str(out))
    assert Tokenizer.from_dir(str(out)).pooling.mode == "mean"
    eos_path, cls_path = str(tmp_path / "eos.gguf"), str(tmp_path / "cls.gguf")
    write_tiny_gguf(eos_path, extra_uint32={"tokenizer.ggml.add_eos_token": 1})
    tok = Tokenizer(load_gguf(eos_path).tokenizer)
    assert tok.encode_input("hello") == tok.encode("hello") + [tok.eos_id]
    write_tiny_gguf(cls_path, extra_uint32={"llama.pooling_type": 2})
    assert "pooling_type 2" in Tokenizer(load_gguf(cls_path).tokenizer).pooling.unsupported


def test_encode_input_follows_the_tokenizers_post_processor(tmp_path):
    """A tokenizer.json whose post-processor closes every input with <|endoftext|> (as Qwen3-Embedding's does):
    encode_input adds it, encode (generation) does not."""
    from tokenizers.processors import TemplateProcessing

    from jaxcb.host.tokenizer import Tokenizer
    from jaxcb.model.embedded import resolve_model
    from jaxcb.model.gguf_loader import load_gguf

    tok = Tokenizer(load_gguf(resolve_model(None)).tokenizer)
    end = tok.token_id("<|endoftext|>")
    tok.save(str(tmp_path))
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    processor = TemplateProcessing(single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", end)])
    spec["post_processor"] = json.loads(processor.__getstate__())
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    again = Tokenizer.from_dir(str(tmp_path))
    assert again.encode_input("A cat.") == again.encode("A cat.") + [end]
    assert again.encode("A cat.")[-1] != end


def test_a_base_models_checkpoint_serves_embeddings_only(tmp_path):
    """A checkpoint saved from the base model, as embedding models are released (MistralModel, Qwen3Model: no
    "model." in its tensors' names, no lm_head): its embeddings are the reference's; a request to generate is
    refused naming the model; a config that asks for bidirectional attention (EmbeddingGemma's) is refused at load."""
    from safetensors.numpy import load_file, save_file

    src = os.path.join(GOLDEN, "qwen3")
    config = json.load(open(os.path.join(src, "config.json")))
    tensors = {k.removeprefix("model."): v for k, v in load_file(os.path.join(src, "model.safetensors")).items()
               if k != "lm_head.weight"}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3Model"]}))
    model_config, params, tok, _ = load_model(str(tmp_path), jnp.float32)
    assert model_config.headless and model_config.tie_embeddings
    llm = LLM.from_params(model_config, params, tok, config=make_config(
        num_pages=64, max_context=128, decode_batch=(4,), prefill_tokens=(32,), compile="fast"))
    for (ids, hidden), out in zip(hidden_records("qwen3"), llm.generate(
            [ids for ids, _ in hidden_records("qwen3")], SamplingParams(max_tokens=0, pooling="mean"))):
        assert close(out.embedding, hidden.mean(0)) < 1e-5
    with pytest.raises(InvalidRequest, match="model: .* has no language-model head .* embeddings and classification only"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["Gemma3TextModel"],
                                                      "use_bidirectional_attention": True}))
    with pytest.raises(InvalidConfig, match="use_bidirectional_attention: bidirectional attention is not supported"):
        load_model(str(tmp_path), jnp.float32)
