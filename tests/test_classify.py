"""Classification (jaxcb.host.classifier): a classifier head on the prompt's last hidden state, the request run by
the engine as a last-token pooling request beside generation.

References: transformers' own *ForSequenceClassification logits for the tiny Qwen3 (three labels) and Gemma 3 (one
label: a cross-encoder) checkpoints (tools/make_tiny_hf.py --classify wrote them), and for a causal LM read by its
tokens' logits (--classifier-from-tokens), SmolLM2's golden prefill logits (transformers' float32)."""

import json
import os

import httpx
import grpc
import numpy as np
import pytest

from jaxcb.host.classifier import Classifier, hf_overrides, parse_tokens
from jaxcb.host.engine_config import load_config, make_config
from jaxcb.host.errors import InvalidConfig, InvalidRequest
from jaxcb.host.request import SamplingParams
from jaxcb.llm import LLM, load_classifier, load_model
from serve.client import Client
from tests.server_util import SMALL_CONFIG, http_server, wait_pool_whole

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
TINY_HF = os.path.join(GOLDEN, "tiny_hf")
SMALL = dict(num_pages=64, page_size=16, max_context=128, decode_batch=(4,), prefill_tokens=(16,),
             max_prefill_tokens=16, compile="fast")


def activation(logits: np.ndarray) -> np.ndarray:
    """transformers' (and vLLM's) reading of a head's logits: sigmoid for one label, else softmax."""
    if len(logits) == 1:
        return 1 / (1 + np.exp(-logits))
    e = np.exp(logits - logits.max())
    return e / e.sum()


@pytest.mark.parametrize("name", ["qwen3-cls", "gemma3-cls"])
def test_sequence_classifiers_match_transformers(name, tmp_path):
    """The checkpoint's score head, labels and activation read from it; every prompt (5 / 23 / 40 tokens, in 16-token
    chunks; Gemma 3's sliding window of 8 far behind) classified within 1e-5 of transformers' probabilities, its
    label the most probable one; the same after `jaxcb convert` (the head saved beside the weights). The model has
    no language-model head: generation is refused naming the model, embeddings are served."""
    from jaxcb.cli import main as cli

    with open(os.path.join(TINY_HF, name, "golden_classify.json")) as f:
        golden = json.load(f)
    prompts = [r["prompt_ids"] for r in golden["records"]]
    want = [activation(np.asarray(r["logits"], np.float64)) for r in golden["records"]]
    out = str(tmp_path / "converted")
    assert cli(["convert", os.path.join(TINY_HF, name), out, "--dtype", "float32"]) == 0
    for path in (os.path.join(TINY_HF, name), out):
        llm = LLM(path, config=make_config(**SMALL))
        head = llm.classifier
        assert head.labels == tuple(golden["labels"]) and head.activation == ("sigmoid" if head.scores else "softmax")
        assert head.scores == (len(golden["labels"]) == 1)
        got = llm.classify(prompts + prompts[::-1])
        for k, c in enumerate(got):
            ref = want[k if k < len(prompts) else 2 * len(prompts) - 1 - k]
            assert np.abs(c.probs - ref).max() < 1e-5, (name, path, k, c.probs, ref)
            assert c.label == golden["labels"][int(np.argmax(ref))]
        with pytest.raises(InvalidRequest, match="model: .* has no language-model head"):
            llm.generate([prompts[0]], SamplingParams(max_tokens=2))
        assert llm.embed([prompts[0]])[0].shape == (llm.model_config.hidden_size,)
        llm.engine.pool.check_all_free()
    if not head.scores:
        with pytest.raises(InvalidRequest, match="model: classifies into 3 labels"):
            llm.score("a", "b")


def smollm2_golden():
    with open(os.path.join(GOLDEN, "smollm2.json")) as f:
        prompts = [r["prompt_ids"] for r in json.load(f)["records"]]
    return prompts, np.load(os.path.join(GOLDEN, "smollm2_prefill_logits.npz"))["logits"].astype(np.float64)


def test_classifier_from_tokens_reads_the_models_logits():
    """--classifier-from-tokens on SmolLM2: "no,yes" is one label, the probability of "yes" between the two
    (Qwen3-Reranker's reading, as vLLM converts it), three tokens are three labels (softmax over their logits); each
    within 1e-5 of transformers' logits at the prompt's last position, the 20 golden prompts batched with generating
    requests; the model generates as before. LLM.score with it scores each pair as one input, the two texts joined
    into one (as vLLM encodes a causal LM reranker's pairs); a head of more labels is refused for scoring; tokens
    outside the vocabulary are refused at load."""
    prompts, logits = smollm2_golden()
    config, params, tok, eos = load_model()
    settings = dict(SMALL, max_context=256, decode_batch=(8,), prefill_tokens=(128,), max_prefill_tokens=128)
    llm = LLM.from_params(config, params, tok, eos_ids=eos,
                          config=make_config(**settings).replace(classifier_from_tokens=("no", "yes")))
    no, yes, maybe = (tok.token_id(t) for t in ("no", "yes", "maybe"))
    assert llm.classifier.labels == ("yes",) and llm.classifier.scores and llm.classifier.joins_pairs
    outs = llm.generate(prompts + prompts[:4], [SamplingParams(max_tokens=0, pooling="last")] * len(prompts)
                        + [SamplingParams(max_tokens=6, ignore_eos=True)] * 4)
    three = load_classifier(None, config, params, tok, ("no", "yes", "maybe"))  # (the same pooled states, read so)
    assert three.labels == ("no", "yes", "maybe") and three.activation == "softmax" and not three.scores
    two = load_classifier(None, config, params, tok, ("no", "yes"), "no_post_processing")  # (a label per token)
    assert two.labels == ("no", "yes") and not two.scores
    for c, ref in zip(outs, logits):
        assert abs(float(llm.classifier.probs(c.embedding)[0]) - 1 / (1 + np.exp(ref[no] - ref[yes]))) < 1e-5
        got, want = three.classify(c.embedding), activation(ref[[no, yes, maybe]])
        assert np.abs(got.probs - want).max() < 1e-5 and got.label == three.labels[int(np.argmax(want))]
        assert np.abs(two.probs(c.embedding) - activation(ref[[no, yes]])).max() < 1e-5
    assert all(len(c.token_ids) == 6 for c in outs[len(prompts):])
    got = llm.classify(prompts[:3])
    assert [c.label for c in got] == ["yes"] * 3 and all(c.probs.shape == (1,) for c in got)
    query, docs = "Is Paris in France?", ["Paris is the capital of France.", "Bananas are yellow."]
    scores = llm.score(query, docs)
    pairs = [tok.encode_input(query + d) for d in docs]
    assert [tok.encode_pair(query, d, llm.classifier.joins_pairs) for d in docs] == pairs
    assert tok.encode_pair(query, docs[0]) == tok.encode(query) + tok.encode(docs[0], add_bos=False)
    direct = llm.generate(pairs, SamplingParams(max_tokens=0, pooling="last"))
    assert np.allclose(scores, [float(llm.classifier.probs(c.embedding)[0]) for c in direct], atol=1e-9)
    llm.engine.pool.check_all_free()
    with pytest.raises(InvalidRequest, match="model: classifies into 3 labels"):
        three.check_scores()
    with pytest.raises(InvalidConfig, match="'zzqx-not-one-token' is not one token"):
        load_classifier(None, config, params, tok, ("no", "zzqx-not-one-token"))


def test_classifier_settings_are_checked():
    """model.classifier_from_tokens in TOML and on the command line; bad values refused when the config is read, a
    model without a head refused when asked to read its tokens; a model without a classifier refuses to classify."""
    assert parse_tokens("no,yes") == ("no", "yes") and parse_tokens(["a"]) == ("a",)
    qwen3_reranker = ('{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], '
                      '"is_original_qwen3_reranker": true}')
    assert hf_overrides(qwen3_reranker) == (("no", "yes"), "from_2_way_softmax")
    assert hf_overrides('{"classifier_from_token": ["Yes"], "method": "no_post_processing"}') == (("Yes",),
                                                                                                 "no_post_processing")
    for bad, message in [('{"rope_scaling": {}}', "'rope_scaling' is not a key this server applies"),
                         ('{"classifier_from_token": ["a"], "method": "from_2_way_softmax"}', "reads two tokens"),
                         ('{"classifier_from_token": ["a", "b"], "method": "mean"}', "'mean' is not one of"),
                         ('{"architectures": ["Qwen3ForSequenceClassification"]}', "classifier_from_token is required"),
                         ('[1]', "must be a JSON object"), ("{", "not JSON")]:
        with pytest.raises(InvalidConfig, match=message):
            hf_overrides(bad)
    for bad in ("no,no", ",", [1], ["x"] * 65):
        with pytest.raises(InvalidConfig, match="model.classifier_from_tokens"):
            parse_tokens(bad)
    head = Classifier(np.ones((2, 4), np.float32), ("a", "b"), "softmax", "test")
    assert head.classify(np.zeros(4, np.float32)).probs.tolist() == [0.5, 0.5]
    with pytest.raises(InvalidConfig, match="has no language-model head to read"):
        LLM(os.path.join(TINY_HF, "qwen3-cls"), config=make_config(**SMALL).replace(classifier_from_tokens=("a",)))
    plain = LLM(os.path.join(TINY_HF, "qwen3"), config=make_config(**SMALL))
    assert plain.classifier is None
    with pytest.raises(InvalidRequest, match="model: has no classifier head"):
        plain.classify([[1, 2, 3]])


def test_config_file_names_the_tokens(tmp_path):
    from jaxcb.cli.args import add_model_args, engine_config
    import argparse

    path = tmp_path / "c.toml"
    assert "[model]\n" in SMALL_CONFIG
    path.write_text(SMALL_CONFIG.replace("[model]\n", '[model]\nclassifier_from_tokens = ["no", "yes"]\n'))
    assert load_config(str(path)).classifier_from_tokens == ("no", "yes")
    p = argparse.ArgumentParser()
    add_model_args(p)
    args = p.parse_args(["--config", str(path), "--classifier-from-tokens", "a,b,c"])
    assert engine_config(args).classifier_from_tokens == ("a", "b", "c")
    args = p.parse_args(["--config", str(path), "--hf_overrides",
                         '{"classifier_from_token": ["no", "yes"], "method": "no_post_processing"}'])
    assert (engine_config(args).classifier_from_tokens, engine_config(args).classifier_method) == (
        ("no", "yes"), "no_post_processing")


@pytest.fixture(scope="module")
def server(tiny_gguf_path, config_path):
    """The tiny model served with a cross-encoder read from two of its tokens."""
    yield from http_server(tiny_gguf_path, config_path, "--classifier-from-tokens", "an,is")


def test_classify_score_and_rerank_over_both_apis_equal_the_offline_engine(server, tiny_model, config_path):
    """/classify and /v1/classify (texts and token ids) and gRPC's Classify give LLM.classify's probabilities and
    labels, vLLM's answer shape, usage counting the inputs' tokens; GetModelInfo names the head. /score and the
    rerank API score each pair by the cross-encoder, as LLM.score does, rerank best first; refusals name the
    field; afterwards every page is free."""
    cfg, params, tok, eos = tiny_model
    offline = LLM.from_params(cfg, params, tok, eos_ids=eos,
                              config=load_config(config_path).replace(classifier_from_tokens=("an", "is")))
    inputs = ["The cat sat on the mat.", [5, 6, 7, 8, 9], "A longer input " * 20]
    want = offline.classify(inputs)
    tokens = [len(tok.encode_input(inputs[0])), 5, len(tok.encode_input(inputs[2]))]
    for path in ("/classify", "/v1/classify"):
        r = httpx.post(server.http + path, json={"input": inputs}, timeout=60)
        body = r.json()
        assert r.status_code == 200 and body["object"] == "list" and body["id"].startswith("classify-"), r.text
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == sum(tokens)
        for i, d in enumerate(body["data"]):
            assert d["index"] == i and d["num_classes"] == 1 and d["label"] == want[i].label == "is"
            assert abs(d["probs"][0] - float(want[i].probs[0])) < 1e-6
    chat = [{"role": "user", "content": "Is this about cats?"}]
    r = httpx.post(server.http + "/v1/classify", json={"messages": chat}, timeout=60).json()
    ids = tok.encode_chat(chat, False)
    assert r["usage"]["prompt_tokens"] == len(ids)
    assert abs(r["data"][0]["probs"][0] - float(offline.classify([ids])[0].probs[0])) < 1e-6
    # vLLM's /pooling: a classifier's task by default, its probabilities as /classify gives them
    pool = httpx.post(server.http + "/pooling", json={"input": inputs}, timeout=60).json()
    assert [d["object"] for d in pool["data"]] == ["pooling"] * 3 and pool["usage"]["prompt_tokens"] == sum(tokens)
    assert np.allclose([d["data"][0] for d in pool["data"]], [float(w.probs[0]) for w in want], atol=1e-6)
    r = httpx.post(server.http + "/pooling", json={"input": inputs, "task": "token_embed"}, timeout=60)
    assert r.status_code == 400 and "task: 'token_embed' is not one of embed, classify" in r.text, r.text
    raw = httpx.post(server.http + "/classify", json={"input": inputs[:1], "use_activation": False}, timeout=60).json()
    logit = float(np.log(want[0].probs[0] / (1 - want[0].probs[0])))
    assert abs(raw["data"][0]["probs"][0] - logit) < 1e-5, raw
    with Client(server.target) as c:
        over_grpc = c.classify(inputs)
        info = c.model_info()
        assert abs(c.classify(inputs[:1], use_activation=False).results[0].probs[0] - logit) < 1e-5
    assert list(info.classifier_labels) == ["is"] and "'an', 'is'" in info.classifier
    assert over_grpc.prompt_tokens == sum(tokens)
    for i, got in enumerate(over_grpc.results):
        assert got.label == "is" and abs(got.probs[0] - float(want[i].probs[0])) < 1e-6 and got.prompt_tokens == tokens[i]

    query, docs = "where do cats sleep", ["Cats sleep on mats.", "Stock prices fell.", "A dog sleeps outside."]
    scores = offline.score(query, docs)
    one = httpx.post(server.http + "/score", json={"text_1": query, "text_2": docs}, timeout=60).json()
    assert np.allclose([d["score"] for d in one["data"]], scores, atol=1e-6), one
    pairs = [len(tok.encode_input(query + d)) for d in docs]
    assert one["usage"]["prompt_tokens"] == sum(pairs)
    pairwise = httpx.post(server.http + "/v1/score", json={"text_1": docs[:2], "text_2": docs[1:]}, timeout=60).json()
    assert np.allclose([d["score"] for d in pairwise["data"]], offline.score(docs[:2], docs[1:]), atol=1e-6)
    order = sorted(range(3), key=lambda k: -scores[k])
    with Client(server.target) as c:
        over_grpc = c.score(query, docs)
    assert np.allclose(over_grpc.scores, scores, atol=1e-6) and over_grpc.prompt_tokens == sum(pairs)
    r = httpx.post(server.http + "/v2/rerank", json={"query": query, "documents": docs, "top_n": 2}, timeout=60).json()
    assert [x["index"] for x in r["results"]] == order[:2]
    assert np.allclose([x["relevance_score"] for x in r["results"]], [scores[k] for k in order[:2]], atol=1e-6)
    for path, body, message in [
            ("/classify", {"input": []}, "input: must be a string"),
            ("/classify", {"input": [[5, 1 << 30]]}, "input: token id 1073741824 is outside the vocabulary"),
            ("/classify", {"input": "x", "dimensions": 3}, "dimensions: not a field this endpoint takes"),
            ("/classify", {"input": "x", "use_activation": "no"}, "use_activation: must be true or false"),
            ("/classify", {"input": ["x"] * 2049}, "input: 2049 inputs; the limit is 2048"),
            ("/classify", {"input": "x", "model": "other"}, "model: 'other' is not served here"),
            ("/score", {"text_1": "a", "text_2": ["b"], "truncate_prompt_tokens": 0}, "truncate_prompt_tokens: must"),
            ("/rerank", {"query": "a", "documents": ["b" * 200000]}, "documents: "),
            ("/rerank", {"query": "a", "documents": ["b"], "instruction": "x"}, "instruction: this server has no score"),
            ("/score", {"text_1": "a", "text_2": "b", "chat_template_kwargs": {"tools": 1}},
             "chat_template_kwargs.tools: set by jaxcb")]:
        r = httpx.post(server.http + path, json=body, timeout=60)
        assert r.status_code in (400, 404) and message in r.json()["error"]["message"], (path, r.text[:300])
    with Client(server.target) as c:
        for inputs, fields, message in [([], {}, "inputs: must not be empty"),
                                        ([[5, 1 << 30]], {}, "inputs: token id 1073741824 is outside the vocabulary")]:
            with pytest.raises(grpc.RpcError) as e:
                c.classify(inputs, **fields)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details(), e.value.details()
        for fields, message in [({"instruction": "x"}, "instruction: this server has no score template"),
                                ({"chat_template_kwargs": "[1]"}, "chat_template_kwargs: must be a JSON object")]:
            with pytest.raises(grpc.RpcError) as e:
                c.score("a", ["b"], **fields)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details(), e.value.details()
        wait_pool_whole(c, 10.0)


SCORE_TEMPLATE = ("{% for m in messages %}{% if m.role == 'query' %}<Instruct>: {{ instruction | default('Judge') }}\n"
                  "<Query>: {{ m.content }}\n{% else %}<Document>: {{ m.content }}{% endif %}{% endfor %}")


def test_a_score_template_writes_each_pair(tiny_model):
    """With a chat template given to the server (vLLM's --chat-template for a reranker), each scored pair is the
    template's rendering of a "query" and a "document" message, with the request's `instruction` (and
    chat_template_kwargs, whose own `instruction` wins); a document's special-token text stays plain text; without
    a template, an instruction is refused by name."""
    cfg, params, tok, eos = tiny_model
    settings = make_config(**SMALL).replace(classifier_from_tokens=("an", "is"))
    llm = LLM.from_params(cfg, params, tok, eos_ids=eos, config=settings.replace(chat_template=SCORE_TEMPLATE))
    assert llm.classifier.templated
    query, docs = "where do cats sleep", ["Cats sleep on mats.", "The market fell."]
    for instruction, kwargs, shown in [(None, None, "Judge"), ("Rank it", None, "Rank it"),
                                       ("Rank it", {"instruction": "Own"}, "Own")]:
        got = llm.score(query, docs, instruction=instruction, chat_template_kwargs=kwargs)
        texts = [f"<Instruct>: {shown}\n<Query>: {query}\n<Document>: {d}" for d in docs]
        plain = [tok.encode(t, add_bos=False) for t in texts]
        direct = llm.generate(plain, SamplingParams(max_tokens=0, pooling="last"))
        assert np.allclose(got, [float(llm.classifier.probs(c.embedding)[0]) for c in direct], atol=1e-9), shown
    forged = llm.tokenizer.encode_pair(query, "The <|im_end|> market", template=True)  # (plain text, as in chats)
    assert tok.special_ids.isdisjoint(forged) and "<|im_end|>" in tok.decode(forged, skip_special=False)
    untemplated = LLM.from_params(cfg, params, tok, eos_ids=eos, config=settings)
    with pytest.raises(InvalidRequest, match="instruction: this server has no score template"):
        untemplated.score(query, docs, instruction="Rank it")
    with pytest.raises(InvalidRequest, match="chat_template_kwargs: this server has no score template"):
        untemplated.score(query, docs, chat_template_kwargs={"x": 1})
    llm.engine.pool.check_all_free()
