"""Offline simulation (a diagnostic for issue 30, not engine code): the base model's OWN plan,
forked. The base model's sequential answers to the 80 vicuna prompts are annotated by the
shipped lineage's annotator (`mixed`: Skeleton-of-Thought where a list forks, APAR otherwise),
and the base model writes every chunk again as its thread would see the answer
(`pasta_engine.train.thread_chunks.rewrite_chunks`: the text before its promise, earlier
siblings as their topics only, the chunk's own opening; greedy, penalty 1.1, to the end of its
line or paragraph). So the intro and the plan are the base model's, and every chunk is written
without the siblings it cannot see. Theoretical content speedup of each annotated answer with
`annotation_content_speedup` (tags as tokens).

Usage: python prototype_base_plan.py BASE_OUTPUTS_JSON OUT_DIR [ANNOTATOR]  (default mixed; independent:
fork only the pieces the lexical independence measure passes)

PLAN_IN_PROMPT=1 (the skeleton variant, ../skeleton-plan-smollm2-cpu/): every chunk's writer also
sees the whole plan, every promise's topic of its answer, later siblings' included, appended to
the question ("Cover these points: A; B; C."), as Skeleton-of-Thought's point expansion sees its
skeleton (Ning et al., ICLR 2024, arXiv 2307.15337, section 2).

SIBLINGS=natural (../natural-siblings-smollm2-cpu/): an earlier sibling of the same group shows,
where `chunk_jobs` puts its topic, as `N. Topic` after a list marker (with the space the marker
takes) and not at all as a paragraph, so the base model reads no line of bare topic words
("proposed explanation maya") that neither it nor a thread ever writes.

FIRST_ITEM=sequential (../first-item-smollm2-cpu/): a list's first item stays on the main thread,
written in sequence, and only the items after it fork, so every forked item's writer sees one whole
item of its list (its length, detail and format) before its own opening, as APAR's rule already
keeps a prose answer's first paragraph. Tests whether the blind items are thin because nothing
shows them how much a sibling says.
"""
import json
import os
import re
import statistics
import sys
from pathlib import Path

from pasta_engine.engine.llm_engine import Engine
from pasta_engine.lang.tags import strip_tags
from pasta_engine.lang.tokenization import eos_token_ids
from pasta_engine.tools.annotate_independent import document_frequencies
from pasta_engine.tools.bench import count_tokens_fn
from pasta_engine.tools.traces import PromptRow
from pasta_engine.train.data import annotation_content_speedup, build_examples
from pasta_engine.train.thread_chunks import rewrite_chunks

base = json.load(open(sys.argv[1]))
out = Path(sys.argv[2])
annotator = sys.argv[3] if len(sys.argv) > 3 else "mixed"
if os.environ.get("SIBLINGS") == "natural":
    import dataclasses

    import pasta_engine.train.thread_chunks as thread_chunks
    _chunk_jobs = thread_chunks.chunk_jobs

    def natural_jobs(annotated, topics, count_tokens, max_new_tokens=256):
        marks = [f"\x00{k}\x00" for k in range(len(topics))]
        jobs = _chunk_jobs(annotated, marks, count_tokens, max_new_tokens)
        out = []
        for job in jobs:
            prefix = job.prefix
            for k, mark in enumerate(marks):
                item = re.search(r"(?m)^[ \t]*(?:[-*+]|\d{1,3}[.)])[ \t]*" + re.escape(mark), prefix)
                prefix = prefix.replace(mark, (" " + topics[k]) if item else "")
            out.append(dataclasses.replace(job, prefix=re.sub(r"\n{3,}", "\n\n", prefix)))
        return out

    thread_chunks.chunk_jobs = natural_jobs
if os.environ.get("FIRST_ITEM") == "sequential":
    import pasta_engine.tools.annotate as annotate_module
    _list_forks = annotate_module._list_forks
    annotate_module._list_forks = lambda response, unit, count, min_tokens: [
        f for f in _list_forks(response, unit, count, min_tokens)
        if len(unit.items) >= 3 and f.start != unit.items[0].fork_start]
rows = [PromptRow(r["instruction"], r["output"], "vicuna", "stop") for r in base]
engine = Engine.from_pretrained(adapter=None, threads=2)
count = count_tokens_fn(engine.tokenizer)
examples, counts = build_examples(rows, count, max_response_tokens=1024, annotator=annotator)
idf = document_frequencies(r.output for r in rows)
if os.environ.get("PLAN_IN_PROMPT") == "1":
    from pasta_engine.train.thread_chunks import _events, chunk_topics
    plans = {}
    for e in examples:
        topics = chunk_topics([x[2] or "" for x in _events(e.annotated) if x[0] == "promise"], idf)
        if topics:
            plans[e.prompt] = f"{e.prompt}\n\nCover these points: " + "; ".join(topics) + "."
    format_prompt = engine.format_prompt
    engine.format_prompt = lambda prompt, mode="pasta", **kw: format_prompt(plans.get(prompt, prompt), mode, **kw)
rewritten, chunk_counts = rewrite_chunks(engine, examples, out, count_tokens=count, idf=idf,
                                         repetition_penalty=1.1, max_new_tokens=256, batch=16)
by_prompt = {e.prompt: e for e in rewritten}
# the speedup counts tags as tokens: the shipped adapter's tokenizer has the PASTA-LANG pieces
tagged = Engine.from_pretrained(threads=1)
eos = eos_token_ids(tagged.tokenizer, tagged.model.config)[0]
outputs, speed = [], []
for r in base:
    e = by_prompt[r["instruction"]]
    outputs.append({"instruction": r["instruction"], "output": strip_tags(e.annotated).strip(),
                    "generator": "base model's plan, chunks rewritten in their threads (simulation)"})
    speed.append(annotation_content_speedup(tagged.tokenizer, e.annotated, eos))
json.dump(outputs, open(out / "model_outputs.json", "w"), indent=1, ensure_ascii=False)
summary = {"annotation": counts, "chunks": chunk_counts, "answers": len(outputs),
           "forked": sum(1 for r in base if "<promise" in by_prompt[r["instruction"]].annotated),
           "geomean_content_speedup": statistics.geometric_mean(speed),
           "command": "python " + " ".join(sys.argv)}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps(summary, indent=1))
