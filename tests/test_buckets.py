import numpy as np
import pytest

from jaxcb.host.batch import SeqSpec, StepShape, pack
from jaxcb.host.buckets import Buckets, bucket_for
from jaxcb.host.engine_config import load_config, make_config


def test_bucket_lookup_never_pads_past_the_largest():
    b = (1, 2, 4, 8)
    assert [bucket_for(b, n, "batch") for n in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    with pytest.raises(ValueError, match="batch: 9 is above the largest bucket 8"):
        bucket_for(b, 9, "batch")


@pytest.mark.parametrize("bad", [(), (4, 2), (1, 1, 2), (0, 2)])
def test_bucket_lists_are_validated(bad):
    with pytest.raises(ValueError, match="buckets.decode_batch"):
        Buckets(bad, (1, 2), (16,))


def test_largest_bucket_must_be_the_configured_maximum():
    with pytest.raises(ValueError, match="buckets.decode_batch: the largest bucket is 16, but the configured maximum is 32"):
        make_config(decode_batch=(1, 16)).replace(max_running=32)


def test_default_config_file_is_valid(tmp_path):
    cfg = load_config()
    assert cfg.buckets.max_batch == cfg.scheduler.max_running >= 32
    bad = tmp_path / "bad.toml"
    bad.write_text("[buckets]\ndecode_batch = [1, 2]\npages_per_seq = [4]\n")
    with pytest.raises(ValueError, match="buckets.prefill_tokens is missing"):
        load_config(str(bad))
    with pytest.raises(ValueError, match="config: file not found"):
        load_config(str(tmp_path / "none.toml"))


def test_served_model_names_from_the_config_and_their_checks(tmp_path):
    from jaxcb.model.embedded import served_name

    path = tmp_path / "c.toml"
    base = "[buckets]\ndecode_batch = [1, 32]\nprefill_tokens = [512]\n"
    for value, names in (('"acme/m"', ("acme/m",)), ('["a", "b"]', ("a", "b"))):
        path.write_text(f"[model]\nserved_model_name = {value}\n" + base)
        assert load_config(str(path)).served_model_name == names
    assert load_config().served_model_name == ()  # the default: the model's own short name
    for value, message in (('["a", "a"]', "names one model twice"), ('["a b"]', "without whitespace"),
                           ('[""]', "must be 1 to 256"), ("5", "must be a list of names")):
        path.write_text(f"[model]\nserved_model_name = {value}\n" + base)
        with pytest.raises(ValueError, match="model.served_model_name: .*" + message):
            load_config(str(path))
    path.write_text('[model]\nserved_model_name = "x"\n[lora]\nmax_loras = 1\nadapters = ["x=/tmp/a"]\n' + base)
    with pytest.raises(ValueError, match="model.served_model_name: 'x' is also a LoRA adapter's name"):
        load_config(str(path))
    assert (served_name(None), served_name("gemma3-270m"), served_name("/m/Qwen3-0.6B/"),
            served_name("/m/smol.Q8_0.gguf")) == ("smollm2-135m", "gemma3-270m", "Qwen3-0.6B", "smol.Q8_0")


def test_packing_lays_sequences_on_one_token_axis():
    # A decode token at position 17 (second page, slot 1) and a 3-token prefill chunk on page 5.
    seqs = [SeqSpec([21], 17, [7, 9]), SeqSpec([11, 12, 13], 0, [5])]
    b = pack(seqs, StepShape(tokens=8, seqs=4, pages_per_seq=3, history=48), page_size=16)
    np.testing.assert_array_equal(b.token_ids, [21, 11, 12, 13, 0, 0, 0, 0])
    np.testing.assert_array_equal(b.positions[:4], [17, 0, 1, 2])
    np.testing.assert_array_equal(b.slot_ids, [9 * 16 + 1, 80, 81, 82, 0, 0, 0, 0])  # padding -> null page
    np.testing.assert_array_equal(b.seq_ids, [0, 1, 1, 1, 4, 4, 4, 4])
    np.testing.assert_array_equal(b.dense, [False, True, True, True, False, False, False, False])
    np.testing.assert_array_equal(b.cu_q_lens, [0, 1, 4, 4, 4])
    np.testing.assert_array_equal(b.kv_lens, [18, 3, 0, 0])
    np.testing.assert_array_equal(b.last_token, [0, 3, 0, 0])
    np.testing.assert_array_equal(b.page_table[:2], [[7, 9, 0], [5, 0, 0]])
    assert (b.page_table[2:] == 0).all() and b.num_seqs[0] == 2
    # Items: the decode sequence's two pages, then the prefill sequence's one; the rest padding.
    np.testing.assert_array_equal(b.item_pages[:4], [7, 9, 5, 0])
    np.testing.assert_array_equal(b.item_owner[:4], [0, 0, 1, 4])
    np.testing.assert_array_equal(b.item_start[:3], [0, 16, 0])
    np.testing.assert_array_equal(b.item_bounds, [2, 3])
    assert b.item_pages.shape == (12,)


def test_packing_refuses_prefill_before_decode_and_overflow():
    shape = StepShape(tokens=4, seqs=2, pages_per_seq=2, history=32)
    with pytest.raises(AssertionError, match="decode sequences must come before"):
        pack([SeqSpec([1, 2], 0, [3]), SeqSpec([4], 5, [6])], shape, page_size=16)
    with pytest.raises(AssertionError, match="do not fit bucket"):
        pack([SeqSpec([1, 2, 3, 4, 5], 0, [3])], shape, page_size=16)


def test_shapes_are_the_token_buckets():
    buckets = Buckets((1, 2, 4), (16,), (16, 64))
    assert buckets.tokens == (1, 2, 4, 20, 68)  # decode steps, and max batch + each chunk size
    shapes = buckets.shapes(page_size=16, max_context=256)
    assert [s.tokens for s in shapes] == [1, 2, 4, 20, 68]
    assert [s.seqs for s in shapes] == [1, 2, 4, 4, 4]
    assert {s.pages_per_seq for s in shapes} == {16}
    assert buckets.step_shape(5, 16, 256).tokens == 20
    with pytest.raises(ValueError, match="step tokens: 69 is above the largest bucket 68"):
        buckets.step_shape(69, 16, 256)


def test_speculation_adds_a_verifying_program_per_bucket_up_to_the_one_its_steps_need():
    """A step with proposals samples at their positions too (a program of its own); steps of up to 10
    tokens may bring them here, so the buckets up to 20 get one, and the one-token bucket cannot."""
    buckets = Buckets((1, 2, 4), (16,), (16, 64))
    shapes = buckets.shapes(page_size=16, max_context=256, extra_rows=8, verify_tokens=10)
    assert [(s.tokens, s.extra_rows) for s in shapes] == [(1, 0), (2, 0), (4, 0), (20, 0), (68, 0), (2, 1), (4, 3),
                                                           (20, 8)]
    assert buckets.verify_limit(10) == 20 and buckets.verify_limit(500) == 68


def test_token_buckets_must_hold_a_full_step():
    with pytest.raises(ValueError, match="buckets.tokens: the largest bucket is 40, but a step can hold 72"):
        make_config(decode_batch=(1, 8), prefill_tokens=(64,), tokens=(1, 8, 40))
