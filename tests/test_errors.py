"""jaxcb's error kinds: what raises which, and how each transport maps them (serve.grpc_api.GRPC_CODE,
serve.openai_fields.HTTP_STATUS)."""

import grpc
import pytest

from jaxcb.host import errors
from jaxcb.host.engine_config import make_config
from jaxcb.host.errors import InvalidConfig, InvalidRequest, JaxcbError, Overloaded, StepFailed, Unavailable
from jaxcb.host.request import SamplingParams
from serve.grpc_api import grpc_code
from serve.openai_fields import http_error

# What each kind must mean on the wire: the same answer on both APIs.
WIRE = {
    errors.InvalidRequest: (grpc.StatusCode.INVALID_ARGUMENT, 400),
    errors.ContextTooLong: (grpc.StatusCode.INVALID_ARGUMENT, 400),  # (a kind of InvalidRequest: OpenAI's code beside)
    errors.NotFound: (grpc.StatusCode.NOT_FOUND, 404),
    errors.Overloaded: (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    errors.Unavailable: (grpc.StatusCode.UNAVAILABLE, 503),
    errors.Unauthenticated: (grpc.StatusCode.UNAUTHENTICATED, 401),
    errors.StepFailed: (grpc.StatusCode.INTERNAL, 500),
    errors.PermissionDenied: (grpc.StatusCode.PERMISSION_DENIED, 403),
}


def _kinds():
    return [k for k in vars(errors).values()
            if isinstance(k, type) and issubclass(k, JaxcbError) and k not in (JaxcbError, InvalidConfig)]


def test_every_request_time_kind_has_one_answer_on_each_transport():
    assert set(_kinds()) == set(WIRE), "a new error kind needs its gRPC code and HTTP status"
    for kind, (code, status) in WIRE.items():
        e = kind("max_tokens: must be >= 1, got 0")
        assert grpc_code(e) == code, kind
        assert http_error(e).status == status, kind
        assert http_error(e).message == str(e)
        assert http_error(e).code == ("context_length_exceeded" if kind is errors.ContextTooLong else None)


def test_a_subclass_takes_its_nearest_kinds_answer_and_an_unknown_kind_is_internal():
    class QueueTooLong(Overloaded):
        pass

    assert grpc_code(QueueTooLong("queue full")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert http_error(QueueTooLong("queue full")).status == 429
    assert grpc_code(JaxcbError("something")) == grpc.StatusCode.INTERNAL
    assert http_error(JaxcbError("something")).status == 500


def test_the_field_is_read_from_the_message():
    assert InvalidRequest("max_tokens: must be >= 1").field == "max_tokens"
    assert InvalidRequest("messages[2].role: 'x' is not one of system, user").field == "messages[2].role"
    assert InvalidRequest("queue full: 3 waiting").field is None  # a phrase, not a field
    assert InvalidRequest("no colon here").field is None
    assert http_error(InvalidRequest("top_p: must be in (0, 1], got 2")).param == "top_p"
    assert http_error(Overloaded("queue: full")).param is None  # only a 400 names a field


def test_request_and_config_errors_are_their_kinds_and_still_value_errors(make_llm):
    engine = make_llm().engine
    with pytest.raises(InvalidRequest, match="top_p: must be in") as e:
        SamplingParams(top_p=2.0)
    assert isinstance(e.value, ValueError) and e.value.field == "top_p"
    with pytest.raises(InvalidRequest, match="prompt: 100000 tokens; the limit is 255"):
        engine.validate([5] * 100_000, SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequest, match="stop_token_ids: token id"):
        engine.validate([5, 6], SamplingParams(max_tokens=2, stop_token_ids=(10**6,)))
    with pytest.raises(InvalidConfig, match="policy: 'lifo' is not one of") as e:
        make_config(policy="lifo")
    assert isinstance(e.value, ValueError)
    with pytest.raises(InvalidConfig, match="buckets.decode_batch: must be strictly increasing"):
        make_config(decode_batch=(4, 2))


def test_a_stopped_engine_thread_refuses_as_unavailable(make_llm):
    from jaxcb.host.engine_thread import EngineThread

    thread = EngineThread(make_llm().engine)  # never started
    with pytest.raises(Unavailable, match="the engine is not running") as e:
        thread.submit([5, 6], SamplingParams(max_tokens=2), lambda ev: None)
    assert isinstance(e.value, RuntimeError)


def test_steps_failing_in_a_row_end_the_engine_as_step_failed(make_llm):
    engine = make_llm(decode_batch=(1,)).engine

    def inject(out):
        raise RuntimeError("the device is gone")

    engine.fault_injector = inject
    for i in range(engine.MAX_FAILED_STEPS_IN_A_ROW + 1):
        engine.add_request([5 + i, 6], SamplingParams(max_tokens=2))
    with pytest.raises(StepFailed, match="steps in a row failed"):
        while engine.has_work():
            engine.step()
    engine.fault_injector = None
    engine.run_until_done()
