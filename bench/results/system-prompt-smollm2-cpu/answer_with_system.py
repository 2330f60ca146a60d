"""The base model (no adapter) answering the 80 vicuna prompts sequentially, greedy with repetition
penalty 1.1, 512 tokens, with the one-line system prompt the adapters are trained and run with
(LEARNED_SYSTEM) instead of the chat template's default: does the system line alone cost quality?

    python bench/results/system-prompt-smollm2-cpu/answer_with_system.py --prompts PATH --out DIR
"""
import argparse
import json
from pathlib import Path

from pasta_engine import Engine, SamplingParams
from pasta_engine.lang.prompts import LEARNED_SYSTEM
from pasta_engine.lang.tokenization import encode_prompt
from pasta_engine.tools.traces import read_prompts
from pasta_engine.train.data import split_rows

ap = argparse.ArgumentParser()
ap.add_argument("--prompts", type=Path, required=True)
ap.add_argument("--out", type=Path, required=True)
args = ap.parse_args()
rows = split_rows(read_prompts(args.prompts), "eval")
eng = Engine.from_pretrained(None, adapter=None, max_running_requests=16)
ids = [encode_prompt(eng.tokenizer, [{"role": "system", "content": LEARNED_SYSTEM},
                                     {"role": "user", "content": r.instruction}], eng.config.prompt_special_tokens)
       for r in rows]
res = eng.generate(ids, SamplingParams(max_new_tokens=512, temperature=0.0, repetition_penalty=1.1, seed=0),
                   mode="sequential", progress=True)
args.out.mkdir(parents=True, exist_ok=True)
(args.out / "model_outputs.json").write_text(json.dumps(
    [{"instruction": r.instruction, "output": x.text, "generator": "base + LEARNED_SYSTEM, sequential",
      "dataset": r.dataset} for r, x in zip(rows, res)], indent=1, ensure_ascii=False) + "\n")
cut = sum(x.stats.finish_reason == "length" for x in res)
(args.out / "summary.json").write_text(json.dumps({"answers": len(res), "cut_at_512": cut, "system": LEARNED_SYSTEM,
                                                    "content_tokens": sum(x.stats.tokens_decoded for x in res)},
                                                   indent=1) + "\n")
print("cut", cut)
