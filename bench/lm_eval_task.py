"""lm-eval-harness against a running server, offline: a multiple-choice task written from the held-out prose
(tests/data/heldout_prose.txt), so lm-eval's `local-completions` model (its loglikelihood requests: token ids,
`echo`, `logprobs: 1`, `max_tokens: 1`) runs with no dataset download, and a comparison of two runs' samples.

    .venv/bin/python -m bench.lm_eval_task write DIR            # DIR/jaxcb_prose_mc.yaml and its data
    lm_eval --model local-completions --model_args model=NAME,base_url=http://HOST:PORT/v1/completions,\
        tokenizer=HF_TOKENIZER_DIR,num_concurrent=8 --tasks jaxcb_prose_mc --include_path DIR \
        --output_path OUT --log_samples                             # lm-eval in its own environment
    .venv/bin/python -m bench.lm_eval_task compare OUT_A OUT_B     # per-choice loglikelihoods, is_greedy, acc

Each document is two consecutive sentences; its choices are the sentence that follows and three others from
elsewhere in the text. `compare` reads each run's samples file and prints how far the loglikelihoods of the
same (document, choice) lie apart, whether lm-eval's is_greedy agrees, and each run's accuracy.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import re

from bench.common import HELDOUT_PROSE

TASK = """task: jaxcb_prose_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def write(folder: str, docs: int, seed: int) -> None:
    text = open(HELDOUT_PROSE, encoding="utf-8").read()
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if len(s.split()) >= 6]
    rng = random.Random(seed)
    os.makedirs(folder, exist_ok=True)
    data = os.path.abspath(os.path.join(folder, "jaxcb_prose_mc.jsonl"))
    with open(data, "w", encoding="utf-8") as f:
        for i in range(2, min(len(sentences) - 1, docs + 2)):
            others = rng.sample([s for j, s in enumerate(sentences) if abs(j - i) > 2], 3)
            choices = others + [sentences[i]]
            rng.shuffle(choices)
            f.write(json.dumps({"context": " ".join(sentences[i - 2:i]), "choices": [" " + c for c in choices],
                                "label": choices.index(sentences[i])}) + "\n")
    with open(os.path.join(folder, "jaxcb_prose_mc.yaml"), "w", encoding="utf-8") as f:
        f.write(TASK.format(data=data))
    print(f"wrote {folder}/jaxcb_prose_mc.yaml and {data}")


def samples(out: str) -> dict:
    """{doc_id: ([(loglikelihood, is_greedy) per choice], acc)} of a run's samples file under `out`."""
    found = sorted(glob.glob(os.path.join(out, "**", "samples_jaxcb_prose_mc_*.jsonl"), recursive=True))
    if not found:
        raise SystemExit(f"{out}: no samples_jaxcb_prose_mc_*.jsonl (run lm_eval with --log_samples)")
    docs = {}
    for line in open(found[-1], encoding="utf-8"):
        s = json.loads(line)
        docs[s["doc_id"]] = ([(float(r[0][0]), r[0][1] in (True, "True")) for r in s["resps"]], s["acc"])
    return docs


def compare(a: str, b: str) -> None:
    x, y = samples(a), samples(b)
    if x.keys() != y.keys():
        raise SystemExit("the two runs scored different documents")
    pairs = [(p, q) for d in x for p, q in zip(x[d][0], y[d][0])]
    diffs = [abs(p[0] - q[0]) for p, q in pairs]
    print(f"{len(pairs)} (document, choice) loglikelihoods: largest difference {max(diffs):.2e} nats, mean "
          f"{sum(diffs) / len(diffs):.2e}; is_greedy the same in {sum(p[1] == q[1] for p, q in pairs)}/{len(pairs)}; "
          f"acc {sum(v[1] for v in x.values()) / len(x):.4f} ({a}) and {sum(v[1] for v in y.values()) / len(y):.4f} ({b})")


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write")
    w.add_argument("folder")
    w.add_argument("--docs", type=int, default=60)
    w.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    args = ap.parse_args()
    if args.command == "write":
        write(args.folder, args.docs, args.seed)
    else:
        compare(args.a, args.b)


if __name__ == "__main__":
    main()
