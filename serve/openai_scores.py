"""Scores, reranking and classification: vLLM's `/score` (text_1 against text_2), the rerank API that Jina,
Cohere and vLLM share (`/rerank`: a query against documents, best first) and vLLM's `/classify`. With a
cross-encoder (a one-label classifier head, jaxcb.host.classifier) each pair runs as one input and scores the
head's probability; otherwise each score is the cosine of the two texts' embeddings (the model's pooling,
jaxcb.host.embedding), as vLLM scores with an embedding model, every text embedded once. `/classify` gives each
input's labels' probabilities through the classifier head. This module reads the bodies and shapes the answers;
serve.openai_api routes them, and serve.frontend.scores (shared with gRPC's Score) runs them."""

from __future__ import annotations

import time
import uuid


from jaxcb.host import classifier
from jaxcb.host.errors import InvalidRequest
from serve.frontend import check_text
from serve.openai_fields import CHAT_INPUT_FIELDS, bool_field, int_field

SCORE_FIELDS = {"model", "text_1", "text_2", "truncate_prompt_tokens", "truncation_side", "priority", "request_id",
                "cache_salt", "user", "instruction", "chat_template_kwargs"}
CLASSIFY_FIELDS = {"model", "input", "use_activation", "truncate_prompt_tokens", "truncation_side", "priority",
                   "request_id", "cache_salt", "user", *CHAT_INPUT_FIELDS}
RERANK_FIELDS = {"model", "query", "documents", "top_n", "return_documents", "truncate_prompt_tokens", "truncation_side",
                 "priority", "request_id", "cache_salt", "user", "instruction", "chat_template_kwargs"}


def _texts(value, field: str) -> list[str]:
    """A string or a non-empty list of strings, as a list."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value or not all(isinstance(t, str) for t in value):
        raise InvalidRequest(f"{field}: must be a string or a non-empty list of strings")
    for t in value:
        check_text(field, t)
    return value


def score_pairs(body: dict) -> tuple[list[str], list[tuple[int, int]]]:
    """vLLM's /score: text_1 (one text or a list) against text_2 (a list): one text against each, or the lists
    pair by pair (of the same length). Returns the texts to embed and each score's (i, j) among them."""
    first, second = _texts(body.get("text_1"), "text_1"), _texts(body.get("text_2"), "text_2")
    return first + second, classifier.score_pairs(len(first), len(second))


def rerank_request(body: dict) -> tuple[list[str], int, bool]:
    """The rerank API's query and documents (strings, or Jina's {"text": ...} objects): the texts to embed (the
    query first), top_n (default: every document) and return_documents (default true)."""
    query = body.get("query")
    if not isinstance(query, str):
        raise InvalidRequest("query: must be a string")
    check_text("query", query)
    documents = body.get("documents")
    if not isinstance(documents, list) or not documents:
        raise InvalidRequest("documents: must be a non-empty list of strings")
    texts = []
    for i, d in enumerate(documents):
        text = d.get("text") if isinstance(d, dict) and set(d) == {"text"} else d
        if not isinstance(text, str):
            raise InvalidRequest(f"documents[{i}]: must be a string (or an object of one field, text)")
        check_text(f"documents[{i}]", text)
        texts.append(text)
    top_n = int_field(body, "top_n", len(texts))
    if top_n < 1:
        raise InvalidRequest(f"top_n: must be >= 1, got {top_n}")
    return [query, *texts], min(top_n, len(texts)), bool_field(body, "return_documents", True)


def score_body(scores: list[float], tokens: int, model_name: str) -> dict:
    return {"id": "score-" + uuid.uuid4().hex, "object": "list", "created": int(time.time()), "model": model_name,
            "data": [{"index": k, "object": "score", "score": s} for k, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


# vLLM's generic pooling API (/pooling): an embedding's fields and a classifier's, the task naming which
POOLING_FIELDS = {"model", "input", "task", "encoding_format", "dimensions", "use_activation", "truncate_prompt_tokens",
                  "truncation_side", "priority", "request_id", "cache_salt", "user", *CHAT_INPUT_FIELDS}
POOLING_TASKS = ("embed", "classify")  # (vLLM's per-token tasks, token_embed and token_classify, are not served)


def pooling_body(results: list, model_name: str) -> dict:
    """vLLM's /pooling answer: per input (State.pool's (its output: a vector, probabilities or base64 text, prompt
    tokens)) its data."""
    tokens = sum(n for _, n in results)
    return {"id": "pool-" + uuid.uuid4().hex, "object": "list", "created": int(time.time()), "model": model_name,
            "data": [{"index": i, "object": "pooling", "data": d} for i, (d, _) in enumerate(results)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                      "prompt_tokens_details": None}}


def classify_body(results: list, model_name: str) -> dict:
    """vLLM's classify answer: per input (State.pool's (Classification, prompt tokens)) its label and
    probabilities."""
    tokens = sum(n for _, n in results)
    return {"id": "classify-" + uuid.uuid4().hex, "object": "list", "created": int(time.time()), "model": model_name,
            "data": [{"index": i, "label": c.label, "probs": [float(p) for p in c.probs], "num_classes": len(c.probs)}
                     for i, (c, _) in enumerate(results)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                      "prompt_tokens_details": None}}


def rerank_body(texts: list[str], scores: list[float], top_n: int, return_documents: bool, tokens: int,
                model_name: str) -> dict:
    """The documents best first (texts[0] is the query), the first top_n of them."""
    order = sorted(range(len(scores)), key=lambda k: -scores[k])[:top_n]
    results = [{"index": k, "relevance_score": scores[k], **({"document": {"text": texts[k + 1]}} if return_documents
                                                              else {})} for k in order]
    return {"id": "rerank-" + uuid.uuid4().hex, "model": model_name, "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
