"""Theoretical content speedup of the clean-context simulation: content tokens / critical path,
critical path = max(main thread's steps, max over chunks of the main's steps through its promise
(+1 for the inserted <async>) + the chunk's tokens (+1 for its end)). Calibrated on the original."""
import json, re, sys, statistics as st
from pasta_engine.engine.llm_engine import Engine
eng = Engine.from_pretrained(threads=1)
tok = eng.tokenizer
orig = [json.loads(l) for l in open(sys.argv[1])]
sim = [json.loads(l) for l in open(sys.argv[2])]
PROM = re.compile(r'<promise topic="[^"]*" tokens="\d+"/>(?:<async>(.*?)</async>)?', re.S)
n = lambda s: len(tok.encode(s, add_special_tokens=False))
def speed(ann, chunks):
    main_steps, pos, ends, content = 0, 0, [], 0
    for k, m in enumerate(PROM.finditer(ann)):
        main_steps += n(ann[pos:m.start()]) + n(ann[m.start():m.end() - len(m.group(0)) + m.group(0).find("/>") + 2])
        pos = m.end()
        c = chunks[k] if chunks is not None else (m.group(1) or "")
        ends.append(main_steps + 1 + n(c) + 1); content += n(c)
    main_steps += n(ann[pos:])
    clean_main = PROM.sub("", ann).replace("<sync/>", "")
    content += n(clean_main)
    return content / max([main_steps] + ends)
so, ss = [], []
for o, s in zip(orig, sim):
    so.append(speed(o["annotated"], None)); ss.append(speed(o["annotated"], s["chunks"]))
print("recorded", round(st.geometric_mean([o["content_speedup"] for o in orig]), 3),
      "recomputed original", round(st.geometric_mean(so), 3), "simulation", round(st.geometric_mean(ss), 3))
