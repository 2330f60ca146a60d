"""Where each answer of a screen forks first: right after a list intro (a line ending with ':',
"colon"), after a list marker ("marker"), elsewhere ("para"), or not at all; with the screen's
speed and proxies. Usage: python fork_contexts.py SCREEN_DIR [...] (rows.jsonl or rows.jsonl.gz)."""
import gzip, json, os, re, sys
for d in sys.argv[1:]:
    rows = [json.loads(l) for l in (gzip.open(f"{d}/rows.jsonl.gz", "rt") if os.path.exists(f"{d}/rows.jsonl.gz") else open(f"{d}/rows.jsonl"))]
    s = json.load(open(f"{d}/summary.json"))
    c = {"colon": 0, "marker": 0, "para": 0, "nofork": 0}
    for r in rows:
        ann = r["annotated"]; i = ann.find("<promise")
        if i < 0: c["nofork"] += 1; continue
        pre = ann[:i].rstrip(" ")
        if re.search(r"(\d+\.|[-*])\s*$", pre): c["marker"] += 1
        elif pre.rstrip().endswith(":"): c["colon"] += 1
        else: c["para"] += 1
    num = sum(1 for r in rows if re.search(r"(?m)^\s*\d+\.", r["text"]))
    print(d, "speedup %.3f forked %d threads %.2f" % (s["geomean_content_speedup"], s["forked"], s["mean_threads"]),
          c, "numbered answers", num, "indep %.2f topic %.2f" % (s["forks_passing_independence"], s["chunks_opening_with_topic"]),
          "d2 %.3f rep %.3f cut %.3f tagtext %d" % (s["proxies"]["mean_distinct_2"], s["proxies"]["mean_repeated_lines"], s["proxies"]["cut_fraction"], s["proxies"]["answers_with_tag_text"]))
