"""Critical path and speedups of hand-built traces (numbers worked out here, then checked against
the replay script, the metrics and a real engine replay), width bounds, and the ``bench``
commands end to end on a tiny preset."""

from __future__ import annotations

import json
import math

import pytest

from pasta_engine import Engine, Limits
from pasta_engine.core.replay import replay_script
from pasta_engine.entrypoints.cli import main
from pasta_engine.lang.tags import ASYNC_CLOSE, ASYNC_OPEN, strip_tags
from pasta_engine.lang.tokenization import encode_text, tokenize_annotated
from pasta_engine.metrics import ResponseStructure, critical_path, geomean, simulate_steps
from pasta_engine.tools.annotate import annotate_sot
from pasta_engine.tools.presets import preset_tokenizer
from pasta_engine.tools.traces import read_traces

PROMPT = "Give me sleep tips."


@pytest.fixture(scope="module")
def unlimited(tiny_llama):
    return Engine.from_pretrained(tiny_llama, kv_cache_bytes=16 * 2**20, limits=Limits(max_threads=None))


def n_tok(engine, text):
    """Tokens of ``text`` in the canonical tokenization (text and tags apart)."""
    return len(tokenize_annotated(engine.tokenizer, text).main_ids)


def check_pieces_tokenize_apart(engine, pieces):
    """The hand count below is valid only if the main text tokenizes piece by piece."""
    whole = tokenize_annotated(engine.tokenizer, "".join(pieces)).main_ids
    assert whole == [t for p in pieces for t in tokenize_annotated(engine.tokenizer, p).main_ids]


def test_hand_built_trace_with_a_sync_that_waits(unlimited):
    e = unlimited
    m1 = 'Tips:\n1. <promise topic="sleep" tokens="30"/>'
    c1 = "Go to bed early and get up at the same time every day, weekends included."
    m2 = '\n2. <promise topic="screens" tokens="10"/>'
    c2 = "Avoid screens."
    m3 = "\n<sync/>"
    m4 = "\nDone."
    annotated = m1 + ASYNC_OPEN + c1 + ASYNC_CLOSE + m2 + ASYNC_OPEN + c2 + ASYNC_CLOSE + m3 + m4
    check_pieces_tokenize_apart(e, [m1, m2, m3, m4])

    # By hand (docs/DESIGN.md section 3): main token i is sampled at step i; a child forked after
    # main token k samples its L tokens (content + </async>) at steps k+1 .. k+L; the sync
    # completed by main token s holds the next main token until every child has ended.
    k1 = n_tok(e, m1)
    k2 = k1 + n_tok(e, m2)
    s = k2 + n_tok(e, m3)
    main_tokens = s + n_tok(e, m4) + 1  # + EOS
    L1, L2 = n_tok(e, c1 + ASYNC_CLOSE), n_tok(e, c2 + ASYNC_CLOSE)
    end1, end2 = k1 + L1, k2 + L2
    assert end1 > s  # the long chunk is still running at the sync: the main thread waits
    cp = max(s, end1, end2) + (main_tokens - s)
    opened = 2 * len(e.open_ids)
    spliced = main_tokens + L1 + L2 + opened  # what one thread decodes for the annotated response
    assert cp < spliced
    content = len(encode_text(e.tokenizer, strip_tags(annotated)))  # the clean text: no tag token, no EOS

    script = replay_script(e.tokenizer, annotated, e.tokenizer.eos_token_id)
    assert script.structure == ResponseStructure(main_tokens, [(k1, L1), (k2, L2)], [s], inserted=opened)
    assert critical_path(script.structure) == cp
    assert script.structure.spliced_tokens == len(script.sequential_ids) == spliced

    [pasta] = e.replay([PROMPT], [annotated])
    [seq] = e.replay([PROMPT], [annotated], mode="sequential")
    assert pasta.annotated_text == annotated
    assert pasta.stats.critical_path == pasta.stats.decode_steps == cp
    assert pasta.stats.content_tokens == content
    assert pasta.stats.content_speedup == pytest.approx(content / cp)
    assert pasta.stats.token_parallelism == pytest.approx((main_tokens + L1 + L2) / cp)
    assert seq.stats.decode_steps == seq.stats.tokens_decoded == spliced
    assert seq.token_ids == pasta.token_ids
    [clean] = e.replay([PROMPT], [pasta.text], mode="sequential")  # the content alone, in one thread
    assert clean.stats.decode_steps == content + 1 and clean.text == pasta.text


def test_hand_built_trace_where_the_end_joins_and_one_without_promises(unlimited):
    e = unlimited
    m1 = 'Tip:\n1. <promise topic="walk" tokens="20"/>'
    c1 = "Walk for half an hour after lunch and again after dinner if you can."
    m2 = "\nBye."
    annotated = m1 + ASYNC_OPEN + c1 + ASYNC_CLOSE + m2
    check_pieces_tokenize_apart(e, [m1, m2])
    k1 = n_tok(e, m1)
    main_tokens = k1 + n_tok(e, m2) + 1
    L1 = n_tok(e, c1 + ASYNC_CLOSE)
    cp = max(main_tokens, k1 + L1)  # end of sequence is an implicit sync
    content = len(encode_text(e.tokenizer, strip_tags(annotated)))
    [r] = e.replay([PROMPT], [annotated])
    assert r.stats.decode_steps == r.stats.critical_path == cp
    assert r.stats.content_speedup == pytest.approx(content / cp)

    plain = "Sleep well. " * 5
    [r] = e.replay([PROMPT], [plain])
    assert r.stats.forks == 0 and r.stats.threads == 1
    assert r.stats.decode_steps == r.stats.critical_path == n_tok(e, plain) + 1
    assert r.stats.content_tokens == n_tok(e, plain) and r.stats.tag_tokens == 0
    assert r.stats.content_speedup == pytest.approx(n_tok(e, plain) / (n_tok(e, plain) + 1))  # EOS is no content


LIST_RESPONSE = (
    "Four ways to sleep better:\n\n"
    "1. Keep the same bedtime every night, weekends included, for a steady rhythm.\n"
    "2. Keep the bedroom dark, quiet and cool, around eighteen degrees.\n"
    "3. Stop drinking coffee after lunch; caffeine lasts for hours.\n"
    "4. Put the phone away an hour before bed and read a paper book.\n\n"
    "Give each habit a couple of weeks before judging it."
)


@pytest.mark.parametrize("width", [None, 1, 2, 3])
def test_replay_steps_of_an_annotated_response_respect_the_width(tiny_llama, width):
    ann = annotate_sot(LIST_RESPONSE)
    assert ann.promises == 4 and ann.syncs == 1
    engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=16 * 2**20, limits=Limits(max_threads=width))
    [r] = engine.replay([PROMPT], [ann.annotated])
    [seq] = engine.replay([PROMPT], [ann.annotated], mode="sequential")
    s = r.stats
    spliced = len(seq.token_ids)
    script = replay_script(engine.tokenizer, ann.annotated, engine.tokenizer.eos_token_id)
    assert s.critical_path == critical_path(script.structure)
    assert s.critical_path <= s.decode_steps <= spliced
    assert s.decode_steps == simulate_steps(script.structure, width)
    if width is None:
        assert s.decode_steps == s.critical_path
    if width == 1:
        assert s.decode_steps == s.tokens_decoded  # one thread at a time: every sampled token costs a step
    assert s.max_width <= (width or len(script.forced_chunks) + 1)
    assert strip_tags(r.annotated_text) == LIST_RESPONSE


# --------------------------------------------------------------------------- the bench commands

SAMPLE = [
    {"instruction": "Give me three tips for better sleep.", "dataset": "sample",
     "output": "Here are three tips:\n\n1. Go to bed at the same time every night, even on weekends.\n"
               "2. Keep your bedroom dark and cool so that you fall asleep faster.\n"
               "3. Avoid coffee after lunch because caffeine stays in the body.\n\nSleep well!"},
    {"instruction": "List two uses of baking soda.", "dataset": "sample",
     "output": "- Cleaning: mix it with water to scrub sinks, ovens and stained mugs.\n"
               "- Baking: it makes cakes and breads rise when it meets an acid."},
    {"instruction": "Say hi.", "dataset": "sample", "output": "Hi! 🙌"},
]


@pytest.fixture(scope="module")
def responses_file(request, tmp_path_factory):
    """Three AlpacaEval rows: the two shortest answers the sot annotator forks and the shortest
    it leaves alone (so the run is quick); a small built-in sample when the data is absent."""
    try:
        path = request.getfixturevalue("alpaca_outputs")
    except pytest.skip.Exception:
        rows = SAMPLE
    else:
        data = sorted(json.loads(path.read_text()), key=lambda r: len(r["output"]))
        listed = (r for r in data if "\n1. " in r["output"] or "\n- " in r["output"])
        forked = [r for _, r in zip(range(2), (r for r in listed if annotate_sot(r["output"]).promises >= 2))]
        plain = next(r for r in data if annotate_sot(r["output"]).promises == 0)
        rows = [*forked, plain]
        assert len(rows) == 3
    out = tmp_path_factory.mktemp("responses") / "responses.json"
    out.write_text(json.dumps(rows))
    return out


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PASTA_ENGINE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


SUMMARY_KEYS = {
    "prompts", "forked_responses", "mean_threads", "geomean_content_speedup", "geomean_realized_content_speedup",
    "geomean_realized_over_theoretical", "geomean_step_speedup", "geomean_token_parallelism", "tag_token_fraction",
    "content_tokens_total", "tokens_decoded_total", "wall_s_total", "wall_s_total_sequential", "text_mismatches",
}
SETTINGS_KEYS = {"model", "preset", "device", "device_name", "dtype", "torch_version", "command_line", "limit",
                 "attention_backend", "position_policy", "max_threads", "annotators"}


def check_speedup_outputs(out, n, width=None):
    summary = json.loads((out / "summary.json").read_text())
    s, settings = summary["summary"], summary["settings"]
    assert SUMMARY_KEYS <= set(s) and SETTINGS_KEYS <= set(settings)
    rows = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    assert len(rows) == n == s["prompts"]
    for r in rows:
        assert r["same_text"]  # the sequential side decoded the pasta answer's clean text
        if width is None:
            assert r["decode_steps"] == r["critical_path"]  # --max-threads 0: unlimited width
        assert r["critical_path"] <= r["decode_steps"] <= r["tokens_decoded"]
        assert r["max_width"] <= (width or r["threads"])
        assert r["decode_steps_sequential"] == r["tokens_sequential"] == r["content_tokens"] + 1  # + EOS, no tags
        assert r["content_speedup"] == pytest.approx(r["content_tokens"] / r["critical_path"])
        assert r["realized_content_speedup"] == pytest.approx(r["wall_s_sequential"] / r["wall_s"])
        assert r["realized_over_theoretical"] == pytest.approx(r["realized_content_speedup"] / r["content_speedup"])
        assert r["tag_tokens"] == r["tokens_decoded"] - 1 - r["content_tokens"]
        if r["forks"] == 0:
            assert r["tag_tokens"] == 0 and r["threads"] == 1
            assert r["content_speedup"] == pytest.approx(r["content_tokens"] / (r["content_tokens"] + 1))
    assert s["geomean_content_speedup"] == pytest.approx(geomean(r["content_speedup"] for r in rows))
    assert s["geomean_realized_content_speedup"] == pytest.approx(geomean(r["realized_content_speedup"] for r in rows))
    assert s["forked_responses"] == sum(r["forks"] > 0 for r in rows)
    assert s["content_tokens_total"] == sum(r["content_tokens"] for r in rows)
    assert s["tag_token_fraction"] == pytest.approx(sum(r["tag_tokens"] for r in rows) / s["tokens_decoded_total"])
    png = (out / "speedup.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000
    return summary, rows


def test_bench_speedup_annotates_on_the_fly(responses_file, cache, tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["bench", "speedup", "--annotator", "sot", "--responses", str(responses_file), "--preset", "tiny-llama",
               "--limit", "3", "--max-threads", "0", "--kv-cache-mb", "16", "--out", str(out)])
    _, err = capsys.readouterr()
    assert rc == 0, err
    summary, rows = check_speedup_outputs(out, 3)
    assert summary["summary"]["forked_responses"] == 2
    assert summary["settings"]["preset"] == "tiny-llama" and "--preset tiny-llama" in summary["settings"]["command_line"]
    assert "bench speedup" in err and "geomean" in err  # progress and summary on stderr
    traces = read_traces(out / "traces.jsonl")
    originals = [r["output"] for r in json.loads(responses_file.read_text())]
    assert [strip_tags(t.annotated_response) for t in traces] == originals
    assert [r["promises"] for r in rows] == [t.promises for t in traces]


def test_bench_annotate_then_speedup_from_the_trace_file(responses_file, cache, tmp_path, capsys):
    traces = tmp_path / "traces.jsonl"
    rc = main(["bench", "annotate", "--annotator", "apar", "--responses", str(responses_file), "--out", str(traces),
               "--preset", "tiny-llama"])
    assert rc == 0
    rows = read_traces(traces)
    originals = json.loads(responses_file.read_text())
    assert len(rows) == 3 and {r.annotator for r in rows} == {"apar"}
    assert [strip_tags(r.annotated_response) for r in rows] == [r.response for r in rows] == [o["output"] for o in originals]
    assert [r.prompt for r in rows] == [o["instruction"] for o in originals]
    assert sum(r.promises for r in rows) >= 2

    out = tmp_path / "run"
    rc = main(["bench", "speedup", "--traces", str(traces), "--preset", "tiny-llama", "--max-threads", "2",
               "--kv-cache-mb", "16", "--out", str(out), "--repeats", "2"])
    _, err = capsys.readouterr()
    assert rc == 0, err
    summary, results = check_speedup_outputs(out, 3, width=2)
    assert summary["settings"]["traces"] == str(traces) and summary["settings"]["repeats"] == 2
    assert summary["settings"]["max_threads"] == 2
    # at width 2 the steps are those the interpreter's policy gives for the trace's structure
    tok = preset_tokenizer("tiny-llama")
    for row, r in zip(rows, results):
        script = replay_script(tok, row.annotated_response, tok.eos_token_id)
        assert r["critical_path"] == critical_path(script.structure)
        assert r["decode_steps"] == simulate_steps(script.structure, 2)
    assert any(r["decode_steps"] > r["critical_path"] for r in results)  # the width limit did bite


def test_bench_speedup_resumes_an_interrupted_run(responses_file, cache, tmp_path, capsys):
    out = tmp_path / "run"
    common = ["bench", "speedup", "--annotator", "sot", "--responses", str(responses_file), "--preset", "tiny-llama",
              "--kv-cache-mb", "16", "--out", str(out)]
    assert main([*common, "--limit", "2"]) == 0
    first = (out / "prompts.jsonl").read_text().splitlines()
    with (out / "prompts.jsonl").open("a") as f:
        f.write('{"index": 2, "prompt": "half a li')  # the line a killed run was writing
    assert main([*common, "--resume"]) == 0
    rows = (out / "prompts.jsonl").read_text().splitlines()
    assert len(rows) == 3 and rows[:2] == first  # kept as measured, not re-run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["resumed_rows"] == 2 and summary["summary"]["prompts"] == 3
    other = tmp_path / "other.json"
    other.write_text(json.dumps(SAMPLE[::-1]))
    rc = main([*common[:5], str(other), *common[6:], "--resume"])
    _, err = capsys.readouterr()
    assert rc == 2 and "prompts.jsonl row 1 is for another prompt" in err
    # a row of an older version (tag-inclusive figures, no content speedup) is not mixed in
    old_rows = [{k: v for k, v in json.loads(line).items() if k != "content_speedup"} for line in rows]
    (out / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old_rows[:2]))
    rc = main([*common, "--resume"])
    _, err = capsys.readouterr()
    assert rc == 2 and "row 1 has no 'content_speedup'" in err and "older pasta-engine" in err


def test_bench_annotate_with_the_model(responses_file, cache, tmp_path, capsys):
    traces = tmp_path / "model.jsonl"
    rc = main(["bench", "annotate", "--annotator", "model", "--responses", str(responses_file), "--limit", "2",
               "--out", str(traces), "--preset", "tiny-llama", "--max-new-tokens", "8", "--kv-cache-mb", "8"])
    assert rc == 0
    rows = read_traces(traces)
    assert len(rows) == 2 and all(r.annotator == "model" for r in rows)
    assert all(strip_tags(r.annotated_response) == r.response for r in rows)


def test_bench_pareto(responses_file, cache, tmp_path, capsys):
    out = tmp_path / "pareto"
    rc = main(["bench", "pareto", "--prompts", str(responses_file), "--preset", "tiny-llama", "--limit", "2",
               "--max-new-tokens", "12", "--temperature", "1.0", "--kv-cache-mb", "16", "--out", str(out)])
    _, err = capsys.readouterr()
    assert rc == 0, err
    instructions = [r["instruction"] for r in json.loads(responses_file.read_text())[:2]]
    rows = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    assert [r["instruction"] for r in rows] == instructions
    for mode, key in (("sequential", "output_sequential"), ("pasta", "output_pasta")):
        exported = json.loads((out / f"model_outputs_{mode}.json").read_text())
        assert [set(x) for x in exported] == [{"instruction", "output", "generator", "dataset"}] * 2
        assert [x["instruction"] for x in exported] == instructions
        assert [x["output"] for x in exported] == [r[key] for r in rows]
        assert len({x["generator"] for x in exported}) == 1 and mode in exported[0]["generator"]
    for r in rows:
        assert r["tokens_pasta"] <= 12 and r["tokens_sequential"] <= 12
        assert list(r)[3:7] == ["content_speedup", "realized_content_speedup", "end_to_end_speedup", "length_ratio"]
        assert r["content_speedup"] == pytest.approx(r["content_tokens_pasta"] / r["critical_path"])
        # the content speedup's two sides do the same work: both are replays (issue 31 item 3)
        assert r["realized_content_speedup"] == pytest.approx(r["wall_s_clean_sequential"] / r["wall_s_pasta_replay"])
        assert r["length_ratio"] == pytest.approx(r["content_tokens_pasta"] / r["content_tokens_sequential"])
        assert r["end_to_end_speedup"] == pytest.approx(r["wall_s_sequential"] / r["wall_s"])
        assert r["throughput_ratio"] == pytest.approx(r["end_to_end_speedup"] * r["length_ratio"])
    s = json.loads((out / "summary.json").read_text())["summary"]
    assert s["prompts"] == 2
    assert s["geomean_length_ratio"] == pytest.approx(math.sqrt(rows[0]["length_ratio"] * rows[1]["length_ratio"]))
    assert s["cut_fraction_pasta"] == sum(r["finish_reason"] == "length" for r in rows) / 2
    assert set(s) >= {"geomean_content_speedup", "geomean_realized_content_speedup", "geomean_end_to_end_speedup",
                      "cut_fraction_sequential", "tag_token_fraction", "fork_rate", "mean_forks", "capped_chunks",
                      "malformed_tags"}


def test_bench_errors_are_one_line_and_named(cache, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "p", "annotated_response": "a"}) + "\n" + "{oops\n")
    rc = main(["bench", "speedup", "--traces", str(bad), "--preset", "tiny-llama", "--out", str(tmp_path / "o")])
    _, err = capsys.readouterr()
    assert rc == 2 and f"{bad}:2" in err and "Traceback" not in err
    rc = main(["bench", "speedup", "--annotator", "sot", "--preset", "tiny-llama", "--out", str(tmp_path / "o")])
    _, err = capsys.readouterr()
    assert rc == 2 and "needs --responses" in err
    with pytest.raises(SystemExit):
        main(["bench", "annotate", "--annotator", "skeleton", "--responses", str(bad), "--out", str(bad)])
    _, err = capsys.readouterr()
    assert "invalid choice: 'skeleton'" in err and "sot" in err and "apar" in err and "model" in err
    with pytest.raises(SystemExit):
        main(["bench", "speedup", "--traces", str(bad), "--preset", "llama-9", "--out", str(tmp_path / "o")])
    _, err = capsys.readouterr()
    assert "llama-9" in err and "llama-3-8b" in err and "tiny-llama" in err
    rc = main(["bench", "annotate", "--annotator", "sot", "--responses", str(tmp_path / "missing.json"),
               "--out", str(tmp_path / "t.jsonl"), "--tokenizer", "approx"])
    _, err = capsys.readouterr()
    assert rc == 2 and "missing.json" in err


# --------------------------------------------------------------------------- presets (model shapes for timing)


def test_presets_are_seeded_sharded_and_load_through_the_normal_loader(tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pasta_engine.tools.presets import build_checkpoint

    one = build_checkpoint("tiny-qwen2", tmp_path / "one")
    sharded = build_checkpoint("tiny-qwen2", tmp_path / "sharded", shard_bytes=40_000)
    other_seed = build_checkpoint("tiny-qwen2", tmp_path / "seed1", seed=1)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(sharded.glob("model-*.safetensors"))
    assert len(files) > 1 and set(index["weight_map"].values()) == {f.name for f in files}
    weights = load_file(one / "model.safetensors")
    assert "lm_head.weight" not in weights  # tied to the embedding: stored once
    parts = {}
    for f in files:
        parts.update(load_file(f))
    assert parts.keys() == weights.keys() and all(torch.equal(parts[k], weights[k]) for k in weights)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in weights.values())
    other = load_file(other_seed / "model.safetensors")
    for name, t in weights.items():
        if "norm" in name:
            assert torch.equal(t, torch.ones_like(t))
        else:  # matrices and q/k/v biases: normal(0, 0.02)
            assert abs(t.float().std().item() - 0.02) < 0.004 and not torch.equal(t, other[name])
    # the normal loader reads the sharded folder; the engine replays on it
    hf = AutoModelForCausalLM.from_pretrained(sharded)
    assert torch.equal(hf.state_dict()["model.layers.0.self_attn.q_proj.bias"],
                       weights["model.layers.0.self_attn.q_proj.bias"])
    engine = Engine.from_pretrained(sharded, kv_cache_bytes=8 * 2**20)
    [r] = engine.replay(["hi"], ['A <promise topic="x" tokens="10"/><async>b c d</async> e'])
    assert r.stats.decode_steps == r.stats.critical_path and r.stats.forks == 1
    # a complete folder with the same stamp is reused, not rewritten
    stamp = (one / "preset.json").stat().st_mtime_ns
    assert build_checkpoint("tiny-qwen2", tmp_path / "one") == one
    assert (one / "preset.json").stat().st_mtime_ns == stamp
    half = build_checkpoint("tiny-qwen2", tmp_path / "one", dtype=torch.bfloat16)  # new stamp: rebuilt
    assert load_file(half / "model.safetensors")["model.embed_tokens.weight"].dtype == torch.bfloat16


def test_a_preset_folder_is_built_by_one_process_at_a_time(tmp_path):
    """bench_dialects' jobs started together on a fresh cache each found no stamp, and one deleted
    model.safetensors while another loaded it: a builder now waits on the folder's lock file and
    then reuses what the holder built."""
    import threading

    from filelock import FileLock

    from pasta_engine.tools.presets import build_checkpoint

    out = tmp_path / "tiny-llama-0"
    got = []
    with FileLock(str(tmp_path / ".tiny-llama-0.lock")):  # another process building this folder
        t = threading.Thread(target=lambda: got.append(build_checkpoint("tiny-llama", out)))
        t.start()
        t.join(timeout=1.0)
        assert t.is_alive() and not (out / "preset.json").exists()  # waits; writes nothing meanwhile
    t.join(timeout=120)
    assert got == [out] and (out / "preset.json").exists() and (out / "model.safetensors").exists()
    stamp = (out / "preset.json").stat().st_mtime_ns
    with FileLock(str(tmp_path / ".tiny-llama-0.lock"), timeout=0):
        assert build_checkpoint("tiny-llama", out) == out  # complete: reused without taking the lock
    assert (out / "preset.json").stat().st_mtime_ns == stamp
