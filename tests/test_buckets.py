import numpy as np
import pytest

from jaxcb.buckets import Buckets, RowSpec, bucket_for, pad_step
from jaxcb.engine import reachable_shapes
from jaxcb.engine_config import load_config, make_config


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


def test_padding_points_at_the_null_page():
    rows = [RowSpec([11, 12, 13], 0, [5]), RowSpec([21], 17, [7, 9])]
    b = pad_step(rows, 4, 4, 3, page_size=16)
    assert b.token_ids.shape == (4, 4) and b.page_table.shape == (4, 3)
    np.testing.assert_array_equal(b.slot_ids[0], [80, 81, 82, 0])  # page 5, then padding -> null page
    assert b.slot_ids[1, 0] == 9 * 16 + 1  # position 17 -> second page, slot 1
    np.testing.assert_array_equal(b.page_table[1], [7, 9, 0])
    np.testing.assert_array_equal(b.kv_lens, [3, 18, 0, 0])
    np.testing.assert_array_equal(b.logits_index, [2, 0, 0, 0])
    assert (b.slot_ids[2:] == 0).all() and (b.page_table[2:] == 0).all()
    assert b.num_rows == 2 and b.num_tokens == 4


def test_reachable_prefill_shapes_have_room_for_their_tokens():
    buckets = Buckets((1, 2), (1, 4, 16), (16, 64))
    shapes = list(reachable_shapes(buckets, page_size=16))
    assert ("prefill", 1, 64, 1) not in shapes  # 17..64 tokens never fit one page
    assert ("prefill", 1, 16, 1) in shapes and ("prefill", 1, 64, 4) in shapes
    assert sum(s[0] == "decode" for s in shapes) == 6
