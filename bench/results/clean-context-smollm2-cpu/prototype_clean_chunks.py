"""Offline simulation: every chunk of the shipped default's forked answers re-written from a clean
context (the question, the main thread's text before its promise with tags removed, the chunk's
topic as its opening): no tag token in the chunk's context. Same weights (shipped adapter, its
lora_scale), greedy, penalty 1.1, up to 120 tokens, pasta mode with max_forks 0 (the grammar masks
every tag piece, as a chunk's does), cut at the first paragraph end after a finished sentence. LORA_SCALE=S in the environment writes
the chunks at another lora_scale (0: the base model's weights; ../base-chunks-smollm2-cpu/).
Usage: python clean_chunks.py ROWS OUT_DIR"""
import json, re, sys, os
from pasta_engine.engine.llm_engine import Engine
from pasta_engine.config import SamplingParams

rows = [json.loads(l) for l in open(sys.argv[1])][: int(os.environ.get("LIMIT", "999"))]
out = sys.argv[2]; os.makedirs(out, exist_ok=True)
from pasta_engine.config import Limits
scale = float(os.environ["LORA_SCALE"]) if "LORA_SCALE" in os.environ else None  # None: the manifest's
eng = Engine.from_pretrained(threads=int(os.environ.get("THREADS", "2")), limits=Limits(max_forks=0), lora_scale=scale)
tok = eng.tokenizer
tags = eng.tag_tokens
stop_ids = sorted(set(x for x in tags.ids if x is not None))
PROM = re.compile(r'<promise topic="([^"]*)" tokens="(\d+)"/>(?:<async>(.*?)</async>)?', re.S)

jobs, plans = [], []
for ri, r in enumerate(rows):
    ann = r["annotated"]
    parts, pos = [], 0
    for m in PROM.finditer(ann):
        parts.append(("main", ann[pos:m.start()]))
        parts.append(("chunk", m.group(1), m.group(3) or ""))
        pos = m.end()
    parts.append(("main", ann[pos:]))
    plans.append(parts)
    main_so_far = ""
    for pi, p in enumerate(parts):
        if p[0] == "main":
            main_so_far += p[1].replace("<sync/>", "")
        else:
            ctx = main_so_far + p[1]
            ids = eng.format_prompt(r["instruction"], mode="pasta") + tok.encode(ctx, add_special_tokens=False)
            jobs.append((ri, pi, ids))
print(len(jobs), "chunks", flush=True)
sp = SamplingParams(temperature=0.0, repetition_penalty=1.1, max_new_tokens=120)
res = eng.generate([j[2] for j in jobs], sp, mode="pasta", progress=True)  # max_forks 0: the grammar masks every tag piece
new = {}
for (ri, pi, _), x in zip(jobs, res):
    new[(ri, pi)] = x.text

def cut(topic, cont):
    """The chunk ends at its first paragraph break after a finished sentence (the engine's clean
    end: not empty, not at a colon); else at its last finished sentence; else as written."""
    from pasta_engine.lang.grammar import chunk_may_end
    text = topic + cont
    i = len(topic)
    while True:
        j = text.find("\n\n", i)
        if j < 0:
            break
        head = text[:j]
        if chunk_may_end(head) and re.search(r"[A-Za-z)\]\"'][.!?]", head):
            return head[len(topic):]
        i = j + 2
    k = max(text.rfind(c) for c in ".!?")
    return text[len(topic):k + 1] if k >= len(topic) else cont
outputs, recs = [], []
for ri, (r, parts) in enumerate(zip(rows, plans)):
    text, chunks = "", []
    for pi, p in enumerate(parts):
        if p[0] == "main":
            text += p[1].replace("<sync/>", "")
        else:
            c = p[1] + cut(p[1], new[(ri, pi)]).rstrip()
            chunks.append(c); text += c
    text = text.strip()
    outputs.append({"instruction": r["instruction"], "output": text, "generator": "clean-context chunks (simulation)"})
    recs.append({"instruction": r["instruction"], "text": text, "chunks": chunks, "orig": r["text"]})
json.dump(outputs, open(out + "/model_outputs.json", "w"), indent=1)
with open(out + "/rows.jsonl", "w") as f:
    for x in recs: f.write(json.dumps(x) + "\n")
