from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PauseGenerationRequest(_message.Message):
    __slots__ = ("mode", "keep_cache")
    MODE_FIELD_NUMBER: _ClassVar[int]
    KEEP_CACHE_FIELD_NUMBER: _ClassVar[int]
    mode: str
    keep_cache: bool
    def __init__(self, mode: _Optional[str] = ..., keep_cache: _Optional[bool] = ...) -> None: ...

class ResumeGenerationRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("model_path", "weight_version", "abort_all_requests")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ABORT_ALL_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    weight_version: str
    abort_all_requests: bool
    def __init__(self, model_path: _Optional[str] = ..., weight_version: _Optional[str] = ..., abort_all_requests: _Optional[bool] = ...) -> None: ...

class SleepRequest(_message.Message):
    __slots__ = ("level", "mode")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    level: int
    mode: str
    def __init__(self, level: _Optional[int] = ..., mode: _Optional[str] = ...) -> None: ...

class WakeUpRequest(_message.Message):
    __slots__ = ("tags",)
    TAGS_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tags: _Optional[_Iterable[str]] = ...) -> None: ...

class WeightsResponse(_message.Message):
    __slots__ = ("message", "paused", "sleeping", "weight_version")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    SLEEPING_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    message: str
    paused: bool
    sleeping: bool
    weight_version: str
    def __init__(self, message: _Optional[str] = ..., paused: _Optional[bool] = ..., sleeping: _Optional[bool] = ..., weight_version: _Optional[str] = ...) -> None: ...

class EmbedInput(_message.Message):
    __slots__ = ("text", "tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    tokens: TokenInput
    def __init__(self, text: _Optional[str] = ..., tokens: _Optional[_Union[TokenInput, _Mapping]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("inputs", "dimensions", "model", "priority", "request_id", "cache_salt", "truncate_prompt_tokens", "truncation_side")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_SIDE_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedCompositeFieldContainer[EmbedInput]
    dimensions: int
    model: str
    priority: int
    request_id: str
    cache_salt: str
    truncate_prompt_tokens: int
    truncation_side: str
    def __init__(self, inputs: _Optional[_Iterable[_Union[EmbedInput, _Mapping]]] = ..., dimensions: _Optional[int] = ..., model: _Optional[str] = ..., priority: _Optional[int] = ..., request_id: _Optional[str] = ..., cache_salt: _Optional[str] = ..., truncate_prompt_tokens: _Optional[int] = ..., truncation_side: _Optional[str] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values", "prompt_tokens")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    prompt_tokens: int
    def __init__(self, values: _Optional[_Iterable[float]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embeddings", "prompt_tokens")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    prompt_tokens: int
    def __init__(self, embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class ClassifyRequest(_message.Message):
    __slots__ = ("inputs", "model", "priority", "request_id", "cache_salt", "truncate_prompt_tokens", "use_activation", "truncation_side")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    USE_ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_SIDE_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedCompositeFieldContainer[EmbedInput]
    model: str
    priority: int
    request_id: str
    cache_salt: str
    truncate_prompt_tokens: int
    use_activation: bool
    truncation_side: str
    def __init__(self, inputs: _Optional[_Iterable[_Union[EmbedInput, _Mapping]]] = ..., model: _Optional[str] = ..., priority: _Optional[int] = ..., request_id: _Optional[str] = ..., cache_salt: _Optional[str] = ..., truncate_prompt_tokens: _Optional[int] = ..., use_activation: _Optional[bool] = ..., truncation_side: _Optional[str] = ...) -> None: ...

class Classification(_message.Message):
    __slots__ = ("label", "probs", "prompt_tokens")
    LABEL_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    label: str
    probs: _containers.RepeatedScalarFieldContainer[float]
    prompt_tokens: int
    def __init__(self, label: _Optional[str] = ..., probs: _Optional[_Iterable[float]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class ClassifyResponse(_message.Message):
    __slots__ = ("results", "prompt_tokens")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[Classification]
    prompt_tokens: int
    def __init__(self, results: _Optional[_Iterable[_Union[Classification, _Mapping]]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("text_1", "text_2", "model", "priority", "request_id", "cache_salt", "truncate_prompt_tokens", "instruction", "chat_template_kwargs", "truncation_side")
    TEXT_1_FIELD_NUMBER: _ClassVar[int]
    TEXT_2_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTION_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_SIDE_FIELD_NUMBER: _ClassVar[int]
    text_1: _containers.RepeatedScalarFieldContainer[str]
    text_2: _containers.RepeatedScalarFieldContainer[str]
    model: str
    priority: int
    request_id: str
    cache_salt: str
    truncate_prompt_tokens: int
    instruction: str
    chat_template_kwargs: str
    truncation_side: str
    def __init__(self, text_1: _Optional[_Iterable[str]] = ..., text_2: _Optional[_Iterable[str]] = ..., model: _Optional[str] = ..., priority: _Optional[int] = ..., request_id: _Optional[str] = ..., cache_salt: _Optional[str] = ..., truncate_prompt_tokens: _Optional[int] = ..., instruction: _Optional[str] = ..., chat_template_kwargs: _Optional[str] = ..., truncation_side: _Optional[str] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("scores", "prompt_tokens")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedScalarFieldContainer[float]
    prompt_tokens: int
    def __init__(self, scores: _Optional[_Iterable[float]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path", "load_inplace")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    LOAD_INPLACE_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    load_inplace: bool
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ..., load_inplace: _Optional[bool] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class LoraAdapterResponse(_message.Message):
    __slots__ = ("message", "done")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    message: str
    done: bool
    def __init__(self, message: _Optional[str] = ..., done: _Optional[bool] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatInput(_message.Message):
    __slots__ = ("messages", "template_kwargs", "add_generation_prompt", "continue_final_message", "chat_template")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    template_kwargs: str
    add_generation_prompt: bool
    continue_final_message: bool
    chat_template: str
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., template_kwargs: _Optional[str] = ..., add_generation_prompt: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ..., chat_template: _Optional[str] = ...) -> None: ...

class TokenInput(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParameters(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "chat", "tokens", "sampling", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "priority", "request_id", "logprobs", "n", "cache_salt", "structured", "speculative", "lora", "model", "min_tokens", "include_stop_str_in_output", "allowed_token_ids", "truncate_prompt_tokens", "prompt_logprobs", "skip_special_tokens", "bad_words", "truncation_side", "repetition_detection", "thinking_token_budget")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_SIDE_FIELD_NUMBER: _ClassVar[int]
    REPETITION_DETECTION_FIELD_NUMBER: _ClassVar[int]
    THINKING_TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: ChatInput
    tokens: TokenInput
    sampling: SamplingParameters
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    priority: int
    request_id: str
    logprobs: int
    n: int
    cache_salt: str
    structured: StructuredOutput
    speculative: bool
    lora: str
    model: str
    min_tokens: int
    include_stop_str_in_output: bool
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    truncate_prompt_tokens: int
    prompt_logprobs: int
    skip_special_tokens: bool
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    truncation_side: str
    repetition_detection: RepetitionDetection
    thinking_token_budget: int
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[ChatInput, _Mapping]] = ..., tokens: _Optional[_Union[TokenInput, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParameters, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., priority: _Optional[int] = ..., request_id: _Optional[str] = ..., logprobs: _Optional[int] = ..., n: _Optional[int] = ..., cache_salt: _Optional[str] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ..., speculative: _Optional[bool] = ..., lora: _Optional[str] = ..., model: _Optional[str] = ..., min_tokens: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., truncate_prompt_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., bad_words: _Optional[_Iterable[str]] = ..., truncation_side: _Optional[str] = ..., repetition_detection: _Optional[_Union[RepetitionDetection, _Mapping]] = ..., thinking_token_budget: _Optional[int] = ...) -> None: ...

class RepetitionDetection(_message.Message):
    __slots__ = ("max_pattern_size", "min_pattern_size", "min_count")
    MAX_PATTERN_SIZE_FIELD_NUMBER: _ClassVar[int]
    MIN_PATTERN_SIZE_FIELD_NUMBER: _ClassVar[int]
    MIN_COUNT_FIELD_NUMBER: _ClassVar[int]
    max_pattern_size: int
    min_pattern_size: int
    min_count: int
    def __init__(self, max_pattern_size: _Optional[int] = ..., min_pattern_size: _Optional[int] = ..., min_count: _Optional[int] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    structural_tag: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ..., structural_tag: _Optional[str] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, values: _Optional[_Iterable[str]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "top", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., rank: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class GenerateFinal(_message.Message):
    __slots__ = ("finish_reason", "usage", "stop_token_id", "stop_string")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    usage: Usage
    stop_token_id: int
    stop_string: str
    def __init__(self, finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., stop_token_id: _Optional[int] = ..., stop_string: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "chunk", "final", "index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk: GenerateChunk
    final: GenerateFinal
    index: int
    def __init__(self, request_id: _Optional[str] = ..., chunk: _Optional[_Union[GenerateChunk, _Mapping]] = ..., final: _Optional[_Union[GenerateFinal, _Mapping]] = ..., index: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "vocab_size", "context_length", "dtype", "num_layers", "num_params", "family", "sliding_window", "num_sliding_layers", "lora_adapters", "served_model_names", "embedding_size", "embedding_pooling", "classifier_labels", "classifier")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMS_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    NUM_SLIDING_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAMES_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_SIZE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_POOLING_FIELD_NUMBER: _ClassVar[int]
    CLASSIFIER_LABELS_FIELD_NUMBER: _ClassVar[int]
    CLASSIFIER_FIELD_NUMBER: _ClassVar[int]
    name: str
    vocab_size: int
    context_length: int
    dtype: str
    num_layers: int
    num_params: int
    family: str
    sliding_window: int
    num_sliding_layers: int
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    served_model_names: _containers.RepeatedScalarFieldContainer[str]
    embedding_size: int
    embedding_pooling: str
    classifier_labels: _containers.RepeatedScalarFieldContainer[str]
    classifier: str
    def __init__(self, name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., context_length: _Optional[int] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_params: _Optional[int] = ..., family: _Optional[str] = ..., sliding_window: _Optional[int] = ..., num_sliding_layers: _Optional[int] = ..., lora_adapters: _Optional[_Iterable[str]] = ..., served_model_names: _Optional[_Iterable[str]] = ..., embedding_size: _Optional[int] = ..., embedding_pooling: _Optional[str] = ..., classifier_labels: _Optional[_Iterable[str]] = ..., classifier: _Optional[str] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("decode_batch_buckets", "pages_per_seq_buckets", "prefill_token_buckets", "page_size", "pages_total", "pages_free", "policy", "compilations", "running", "waiting", "preemptions", "tensor_parallel", "data_parallel", "replicas", "platform", "compute_dtype", "weights", "kv_dtype", "attention", "cpu_dots", "cpu_max_isa", "cpu_dots_reason", "speculative_method", "num_speculative_tokens", "speculative_acceptance_rate", "speculative_mean_accepted_length", "speculative", "sampling_defaults", "weight_version", "paused", "sleeping")
    class SamplingDefaultsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    DECODE_BATCH_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    PAGES_PER_SEQ_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKEN_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PAGES_FREE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    COMPILATIONS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    CPU_DOTS_FIELD_NUMBER: _ClassVar[int]
    CPU_MAX_ISA_FIELD_NUMBER: _ClassVar[int]
    CPU_DOTS_REASON_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    SLEEPING_FIELD_NUMBER: _ClassVar[int]
    decode_batch_buckets: _containers.RepeatedScalarFieldContainer[int]
    pages_per_seq_buckets: _containers.RepeatedScalarFieldContainer[int]
    prefill_token_buckets: _containers.RepeatedScalarFieldContainer[int]
    page_size: int
    pages_total: int
    pages_free: int
    policy: str
    compilations: int
    running: int
    waiting: int
    preemptions: int
    tensor_parallel: int
    data_parallel: int
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaInfo]
    platform: str
    compute_dtype: str
    weights: str
    kv_dtype: str
    attention: str
    cpu_dots: str
    cpu_max_isa: str
    cpu_dots_reason: str
    speculative_method: str
    num_speculative_tokens: int
    speculative_acceptance_rate: float
    speculative_mean_accepted_length: float
    speculative: str
    sampling_defaults: _containers.ScalarMap[str, float]
    weight_version: str
    paused: bool
    sleeping: bool
    def __init__(self, decode_batch_buckets: _Optional[_Iterable[int]] = ..., pages_per_seq_buckets: _Optional[_Iterable[int]] = ..., prefill_token_buckets: _Optional[_Iterable[int]] = ..., page_size: _Optional[int] = ..., pages_total: _Optional[int] = ..., pages_free: _Optional[int] = ..., policy: _Optional[str] = ..., compilations: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., preemptions: _Optional[int] = ..., tensor_parallel: _Optional[int] = ..., data_parallel: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[ReplicaInfo, _Mapping]]] = ..., platform: _Optional[str] = ..., compute_dtype: _Optional[str] = ..., weights: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., attention: _Optional[str] = ..., cpu_dots: _Optional[str] = ..., cpu_max_isa: _Optional[str] = ..., cpu_dots_reason: _Optional[str] = ..., speculative_method: _Optional[str] = ..., num_speculative_tokens: _Optional[int] = ..., speculative_acceptance_rate: _Optional[float] = ..., speculative_mean_accepted_length: _Optional[float] = ..., speculative: _Optional[str] = ..., sampling_defaults: _Optional[_Mapping[str, float]] = ..., weight_version: _Optional[str] = ..., paused: _Optional[bool] = ..., sleeping: _Optional[bool] = ...) -> None: ...

class ReplicaInfo(_message.Message):
    __slots__ = ("replica", "device_ids", "pages_total", "pages_free", "running", "waiting", "preemptions", "pending_tokens", "requests_routed")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PAGES_FREE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PENDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_ROUTED_FIELD_NUMBER: _ClassVar[int]
    replica: int
    device_ids: _containers.RepeatedScalarFieldContainer[int]
    pages_total: int
    pages_free: int
    running: int
    waiting: int
    preemptions: int
    pending_tokens: int
    requests_routed: int
    def __init__(self, replica: _Optional[int] = ..., device_ids: _Optional[_Iterable[int]] = ..., pages_total: _Optional[int] = ..., pages_free: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., preemptions: _Optional[int] = ..., pending_tokens: _Optional[int] = ..., requests_routed: _Optional[int] = ...) -> None: ...
