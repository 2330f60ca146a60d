"""Prototype (not shipped): a promise's topic may not open with a word that leans on what came
before (a connective, anaphora or sequence word: "Another", "Furthermore", "This", "Finally",
...; the single words of pasta_engine.tools.annotate_independent._LEANS_ON). The chunk opens with
its topic's words, so a chunk promised "Another challenge" opens by leaning on a sibling it cannot
see. At the topic's first word, every token that is one of those words (any case, with or
without its leading space) is masked. Usage: python prototype_screen.py <screen args>"""
import sys
import pasta_engine.core.scheduler as sch
from pasta_engine.engine.llm_engine import Engine
from pasta_engine.lang.grammar import GrammarState

WORDS = ("now then next finally lastly also another other additionally furthermore moreover however but and so "
         "thus therefore overall this these that those it its it's they their he she his her such similarly "
         "likewise after afterwards once remember meanwhile again still instead otherwise repeat step").split()
S = {}
Orig = sch.SamplingRow

def row(rid, tid, params, forced, grammar, seen, ends, thr, rng):
    if forced is None and S and grammar in (GrammarState.TOPIC_EMPTY, GrammarState.TOPIC):
        req = sys._getframe(1).f_locals.get("req")
        t = req.interp.threads[tid]
        toks = t.tokens
        k = max(i for i, x in enumerate(toks) if x == S["open"])
        so_far = S["tok"].decode(list(toks[k + 1:]), skip_special_tokens=False)
        if not so_far.strip(" *_\"'`#-"):
            ends = tuple(sorted(set(ends) | S["ids"]))
            S["n"] = S.get("n", 0) + 1
    return Orig(rid, tid, params, forced, grammar, seen, ends, thr, rng)
sch.SamplingRow = row

orig_fp = Engine.from_pretrained.__func__
def from_pretrained(cls, *a, **kw):
    eng = orig_fp(cls, *a, **kw)
    tok = eng.tokenizer
    S["open"] = eng.tag_tokens.promise_open
    S["tok"] = tok
    ids = set()
    for i in range(len(tok)):
        w = tok.decode([i]).strip().lower()
        if w in WORDS:
            ids.add(i)
    S["ids"] = ids
    print("leaning topic openings masked:", len(ids), "token ids", flush=True)
    return eng
Engine.from_pretrained = classmethod(from_pretrained)
sys.argv[0] = "bench/screen_adapter.py"
import runpy
runpy.run_path("bench/screen_adapter.py", run_name="__main__")
print("topic openings masked:", S.get("n", 0), flush=True)
