"""Offline simulation (a diagnostic for issue 30, not engine code): the base model's own answers,
forked as in ../base-plan-smollm2-cpu/ (the `mixed` annotator, the same chunks and budgets), but
every chunk is written with its EARLIER SIBLINGS VISIBLE AS THEY ARE BEING WRITTEN (lockstep:
at each decode step a chunk attends to what each earlier sibling of its group has written up to
that step), as Hogwild! Inference (Rodionov et al. 2025, arXiv 2504.06261) lets parallel workers
see each other's partial KV. No decode step is added: the threads still advance together, one
token each per step; only the attention view grows.

Layout (one key/value sequence per group, append-only, positions reserved as PASTA's
`predicted` policy reserves them): the shared text before the group's first promise; then per
chunk, in reading order, the main thread's text before it (list markers) and its opening (the
original chunk's first words, forced as in `rewrite_chunks`), at positions after the earlier
siblings' reserved ranges (each the original chunk's token count); its generated tokens at the
positions after its opening. A chunk's query sees the shared text, the static text of itself
and of every earlier chunk, its own earlier tokens, and each earlier sibling's tokens generated
up to the same step; never a later sibling. Greedy, repetition penalty 1.1 over the tokens the
chunk sees (HF's rule), each chunk's stop strings and budget as `chunk_jobs` sets them, the
result cut by `_finish` (fragments cut at the last sentence end), reassembled by `assemble`.

Usage: [FIRST_ITEM=sequential] python prototype_peek.py BASE_OUTPUTS_JSON OUT_DIR [--no-peek]
(--no-peek: the same layout with the siblings' generated tokens hidden: their openings only.)
"""
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from pasta_engine.engine.llm_engine import Engine
from pasta_engine.lang.tags import strip_tags
from pasta_engine.lang.tokenization import eos_token_ids
from pasta_engine.models.loader import embedded_model_dir
from pasta_engine.tools.annotate_independent import document_frequencies
from pasta_engine.tools.bench import count_tokens_fn
from pasta_engine.tools.traces import PromptRow
from pasta_engine.train.data import annotation_content_speedup, build_examples
from pasta_engine.train.thread_chunks import _events, _finish, _is_item_line, assemble, chunk_jobs, chunk_topics

torch.set_num_threads(2)
base = json.load(open(sys.argv[1]))
out = Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
PEEK = "--no-peek" not in sys.argv
PENALTY = 1.1
NEG = torch.finfo(torch.float32).min

if os.environ.get("FIRST_ITEM") == "sequential":
    # as ../base-plan-smollm2-cpu/prototype_base_plan.py: a list's first item stays in sequence
    import pasta_engine.tools.annotate as annotate_module
    _list_forks = annotate_module._list_forks
    annotate_module._list_forks = lambda response, unit, count, min_tokens: [
        f for f in _list_forks(response, unit, count, min_tokens)
        if len(unit.items) >= 3 and f.start != unit.items[0].fork_start]
rows = [PromptRow(r["instruction"], r["output"], "vicuna", "stop") for r in base]
engine = Engine.from_pretrained(adapter=None, threads=2)
tok = engine.tokenizer
count = count_tokens_fn(tok)
examples, counts = build_examples(rows, count, max_response_tokens=1024, annotator="mixed")
idf = document_frequencies(r.output for r in rows)
model = AutoModelForCausalLM.from_pretrained(embedded_model_dir(), dtype=torch.float32).eval()
EOS = set(eos_token_ids(tok, model.config))


def enc(text):
    return engine.encode(text) if text else []


def groups_of(jobs, topics):
    """Jobs split into groups of siblings (no <sync/> between them), each job with the main
    thread's text between the previous sibling's chunk and its own promise."""
    groups, cur = [], []
    for k, job in enumerate(jobs):
        before = job.prefix[: len(job.prefix) - len(job.opening)]
        if cur:
            pk, pbefore = cur[-1][0], cur[-1][2]
            insert = (" " if _is_item_line(pbefore) and not pbefore[-1:].isspace() else "") + topics[pk]
            if before.startswith(pbefore + insert):
                cur.append((k, before[len(pbefore + insert):], before))
                continue
            groups.append(cur)
            cur = []
        cur.append((k, None, before))
    if cur:
        groups.append(cur)
    return groups


@torch.no_grad()
def write_group(head, jobs, group):
    """Decode one group's chunks in lockstep; returns {k: (continuation, finish_reason)}."""
    shared = head + enc(group[0][2])
    toks, pos, owner, tau = list(shared), list(range(len(shared))), [-1] * len(shared), [-1] * len(shared)
    nxt = len(shared)
    chunks = []  # per chunk: k, job, static token index range, reserved start of its generation
    for k, between, _ in group:
        job = jobs[k]
        start = len(toks)
        for t in enc(between or "") + enc(job.opening):
            toks.append(t)
            pos.append(nxt)
            owner.append(k)
            tau.append(-1)
            nxt += 1
        reserve = max(1, count(job.content) - len(enc(job.opening)))
        chunks.append({"k": k, "job": job, "static": (start, len(toks)), "gen_pos": nxt, "gen": [], "done": None,
                       "active": bool(job.content.strip())})
        nxt += reserve
    order = {c["k"]: i for i, c in enumerate(chunks)}

    def visible(q_owner, q_tau, q_index):
        """Keys a query (owner chunk, step time, its index in toks) sees, as a bool list over toks."""
        qi = order[q_owner]
        vis = []
        for j in range(len(toks)):
            o = owner[j]
            if o == -1:
                v = True
            elif o == q_owner:
                v = j <= q_index
            elif order[o] < qi:
                v = tau[j] == -1 or (PEEK and tau[j] <= q_tau)
            else:
                v = False
            vis.append(v)
        return vis

    cache = DynamicCache()
    fed = 0
    # every chunk's last input token (its query): the opening's last token first
    last = {c["k"]: c["static"][1] - 1 for c in chunks}
    step = 0
    while any(c["active"] and c["done"] is None for c in chunks):
        new = list(range(fed, len(toks)))
        mask = torch.full((1, 1, len(new), len(toks)), NEG)
        for r, i in enumerate(new):
            if owner[i] == -1:
                mask[0, 0, r, : i + 1] = 0.0
            else:
                mask[0, 0, r] = torch.where(torch.tensor(visible(owner[i], tau[i], i)), 0.0, NEG)
        o = model(input_ids=torch.tensor([[toks[i] for i in new]]), position_ids=torch.tensor([[pos[i] for i in new]]),
                  attention_mask=mask, past_key_values=cache, use_cache=True)
        cache = o.past_key_values
        logits = o.logits[0]
        fed = len(toks)
        appended = []
        for c in chunks:
            if not c["active"] or c["done"] is not None:
                continue
            qi = last[c["k"]]
            row = logits[new.index(qi)].clone()
            seen = torch.tensor(sorted({toks[j] for j, v in enumerate(visible(c["k"], tau[qi], qi)) if v}))
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / PENALTY, vals * PENALTY)
            t = int(row.argmax())
            c["gen"].append(t)
            job = c["job"]
            text = tok.decode(c["gen"], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            cut = min((text.find(s) for s in job.stop if s in text), default=-1)
            if t in EOS:
                c["done"] = (tok.decode(c["gen"][:-1], skip_special_tokens=False, clean_up_tokenization_spaces=False), "eos")
            elif cut >= 0:
                c["done"] = (text[:cut], "stop")
            elif len(c["gen"]) >= job.max_new_tokens:
                c["done"] = (text, "length")
            if c["done"] is None or PEEK:  # its token goes into the cache for its siblings to see
                appended.append((c, t))
        for c, t in appended:
            toks.append(t)
            pos.append(c["gen_pos"] + len(c["gen"]) - 1)
            owner.append(c["k"])
            tau.append(step)
            last[c["k"]] = len(toks) - 1
        step += 1
    return {c["k"]: c["done"] for c in chunks if c["active"]}


t0 = time.perf_counter()
done_rows = {}
log = out / "examples.jsonl"
if log.exists():
    for line in log.read_text().splitlines():
        r = json.loads(line)
        done_rows[r["prompt"]] = r
how_counts = {"stop": 0, "cut": 0, "original": 0}
for n, e in enumerate(examples):
    if e.prompt in done_rows:
        continue
    topics = chunk_topics([x[2] or "" for x in _events(e.annotated) if x[0] == "promise"], idf)
    if not topics:
        row = {"prompt": e.prompt, "annotated": e.annotated, "chunks": []}
    else:
        jobs = chunk_jobs(e.annotated, topics, count, 256)
        head = engine.format_prompt(e.prompt, mode="sequential")
        texts = [job.content for job in jobs]
        how = ["original"] * len(jobs)
        for g in groups_of(jobs, topics):
            for k, (cont, reason) in write_group(head, jobs, g).items():
                texts[k], how[k] = _finish(jobs[k], cont, reason)
        row = {"prompt": e.prompt, "annotated": assemble(e.annotated, chunk_topics(texts, idf), texts, count),
               "chunks": how}
    with log.open("a") as f:
        f.write(json.dumps(row, ensure_ascii=False) + "\n")
    done_rows[e.prompt] = row
    print(f"{len(done_rows)}/{len(examples)} answers, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

tagged = Engine.from_pretrained(threads=1)
eos = eos_token_ids(tagged.tokenizer, tagged.model.config)[0]
outputs, speed = [], []
for r in base:
    row = done_rows[r["instruction"]]
    for h in row["chunks"]:
        how_counts[h] += 1
    outputs.append({"instruction": r["instruction"], "output": strip_tags(row["annotated"]).strip(),
                    "generator": f"base model's plan, chunks written in lockstep {'seeing' if PEEK else 'without'} "
                                 "earlier siblings' progress (simulation)"})
    speed.append(annotation_content_speedup(tagged.tokenizer, row["annotated"], eos))
json.dump(outputs, open(out / "model_outputs.json", "w"), indent=1, ensure_ascii=False)
summary = {"annotation": counts, "chunks": how_counts, "answers": len(outputs), "peek": PEEK,
           "forked": sum(1 for r in base if "<promise" in done_rows[r["instruction"]]["annotated"]),
           "geomean_content_speedup": statistics.geometric_mean(speed),
           "first_item": os.environ.get("FIRST_ITEM", ""),
           "command": "python " + " ".join(sys.argv)}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps(summary, indent=1))
