"""Greedy outputs against the golden reference (tests/golden, tools/make_golden.py), shared by the parity,
tensor-parallel and dot-library tests."""

MARGIN = 1e-2  # a difference is acceptable only where the reference's top two logits were this close


def check_against_golden(outs, golden):
    full = 0
    for out, rec in zip(outs, golden["records"]):
        got, want, margins = out.token_ids, rec["greedy_ids"], rec["margins"]
        assert len(got) == len(want)
        first_diff = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if first_diff is None:
            full += 1
            continue
        # A difference is only acceptable at or after a step where the reference itself was nearly tied.
        assert min(margins[: first_diff + 1]) < MARGIN, (rec["text"], first_diff, got, want)
    assert full >= 0.9 * len(outs), f"only {full}/{len(outs)} prompts match in full"
    return full
