"""The command line's edges (issue 20): every error a user can cause is one stderr line naming
the flag or file, with exit status 2; a run whose request ends in ``error`` exits 1; Ctrl-C
prints what was decoded so far and exits 130 without a traceback, in ``generate`` and in
``serve``."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from pasta_engine import Engine
from pasta_engine.entrypoints.cli import main

TINY_RUN = ["--kv-cache-mb", "8", "--max-new-tokens", "4"]


def _one_error_line(err: str, *pieces: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("pasta-engine: error:") and all(p in lines[0] for p in pieces), lines[0]


def test_version_is_the_package_metadata(capsys):
    import pasta_engine

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    out, _ = capsys.readouterr()
    assert e.value.code == 0
    assert out.strip() == f"pasta-engine {importlib.metadata.version('pasta-engine')}" == f"pasta-engine {pasta_engine.__version__}"


def test_a_prompt_that_is_not_utf8_is_one_line(tiny_llama, capsys):
    # a command line holding byte 0xff reaches Python as the lone surrogate U+DCFF
    rc = main(["generate", "hi \udcff there", "--model", str(tiny_llama), *TINY_RUN])
    _, err = capsys.readouterr()
    assert rc == 2
    _one_error_line(err, "prompt argument", "byte 0xff")


def test_a_kv_cache_larger_than_the_machine_is_one_line(tiny_llama, capsys):
    rc = main(["generate", "hi", "--model", str(tiny_llama), "--kv-cache-mb", "99999999"])
    _, err = capsys.readouterr()
    assert rc == 2
    _one_error_line(err, "99999999 MiB", "--kv-cache-mb")


def test_a_replay_that_ends_in_error_exits_1(tiny_llama, tmp_path, capsys):
    """Eight promises need more pages of 256 tokens than 1 MiB holds (8): the request ends with
    finish_reason "error", which the exit status now says (it was 0)."""
    ann = "List: " + " ".join(f'<promise topic="p{i}" tokens="10"/><async>item {i}.</async>' for i in range(8)) + "<sync/> end"
    traces = tmp_path / "t.jsonl"
    traces.write_text(json.dumps({"prompt": "list", "annotated_response": ann}) + "\n")
    rc = main(["replay", "--traces", str(traces), "--model", str(tiny_llama), "--kv-cache-mb", "1", "--page-size", "256",
               "--json"])
    out, err = capsys.readouterr()
    assert json.loads(out)["pasta"]["stats"]["finish_reason"] == "error"
    assert rc == 1 and "pasta-engine: error: 1 of 1 runs ended with an error (prompt 0 pasta" in err


def test_ctrl_c_in_generate_prints_the_partial_answer_and_exits_130(tiny_llama, capsys, monkeypatch):
    """A KeyboardInterrupt in the 6th step (inside the forward, as a real Ctrl-C lands): the
    request's 5 tokens so far are printed, then one line, status 130."""
    calls = [0]
    step = Engine._step

    def interrupted(self):
        calls[0] += 1
        if calls[0] == 6:
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(Engine, "_step", interrupted)
    rc = main(["generate", "hi", "--model", str(tiny_llama), "--kv-cache-mb", "8", "--max-new-tokens", "50", "--json"])
    out, err = capsys.readouterr()
    assert rc == 130 and "Traceback" not in err and err.strip().splitlines()[-1] == "pasta-engine: interrupted"
    row = json.loads(out)
    assert row["interrupted"] is True and row["index"] == 0 and len(row["pasta"]["token_ids"]) == 5


def _as_from_a_shell() -> None:
    """In the child before exec: SIGINT at its default and unblocked, as a shell starts a program
    (a child inherits an ignored or blocked SIGINT from the test process, whatever set it there)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _popen(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "pasta_engine.entrypoints.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, preexec_fn=_as_from_a_shell)


def _wait_for(stream, text: str, timeout_s: float = 120.0) -> str:
    """Read ``stream`` until a line holds ``text`` (returns what was read)."""
    seen, deadline = "", time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        seen += line
        if text in line:
            return seen
    raise AssertionError(f"never saw {text!r}:\n{seen[-2000:]}")


def _wait_for_bytes(fd: int, text: bytes, timeout_s: float = 120.0) -> bytes:
    """Read the pipe ``fd`` until ``text`` shows, straight from the descriptor: a text-mode
    readline holds a line that ends in ``\r`` (tqdm's bar) until more output arrives, which can
    be the end of the run (the fresh-clone suite saw exit 0: the SIGINT came after the last prompt)."""
    import select

    seen, deadline = b"", time.monotonic() + timeout_s
    while time.monotonic() < deadline and text not in seen:
        if select.select([fd], [], [], 1.0)[0]:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            seen += chunk
    if text not in seen:
        raise AssertionError(f"never saw {text!r}:\n{seen[-2000:]!r}")
    return seen


def test_a_real_ctrl_c_in_generate_keeps_the_output(tiny_llama, tmp_path):
    """SIGINT to a real process while it decodes the first of two prompts (the progress bar is
    up): the interrupted prompt's partial answer comes out as JSON, no traceback, status 130."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("first prompt\nsecond prompt\n")
    proc = _popen(["generate", "--prompts-file", str(prompts), "--model", str(tiny_llama), "--kv-cache-mb", "8",
                   "--max-new-tokens", "4000", "--ignore-eos", "--json"])
    # --ignore-eos: both prompts run to 4000 tokens, whatever the random model's greedy tokens
    try:
        _wait_for_bytes(proc.stderr.fileno(), b"0/2")  # the bar: the engine is built and decoding
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err and "pasta-engine: interrupted" in err, (
        proc.returncode, signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, []), err[-1500:])
    row = json.loads(out.strip().splitlines()[-1])
    assert row["interrupted"] is True and row["index"] in (0, 1) and 0 < len(row["pasta"]["token_ids"]) < 4000


# --------------------------------------------------------------------------- serve

needs_serve = pytest.mark.skipif(importlib.util.find_spec("uvicorn") is None or importlib.util.find_spec("fastapi") is None,
                                 reason="the serve extra (fastapi, uvicorn) is not installed")


def _busy_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


@needs_serve
@pytest.mark.parametrize("where, pieces", [
    (["--host", "no-such-host.invalid"], ["--host no-such-host.invalid", "unknown host"]),
    (["--port", "BUSY"], ["already in use"]),
])
def test_serve_cannot_listen_is_one_line(tiny_llama, capsys, where, pieces):
    busy = _busy_port()
    try:
        port = str(busy.getsockname()[1])
        where = [port if w == "BUSY" else w for w in where]
        rc = main(["serve", "--model", str(tiny_llama), "--kv-cache-mb", "8", "--log-level", "warning", *where])
    finally:
        busy.close()
    _, err = capsys.readouterr()
    assert rc == 2
    _one_error_line("\n".join(line for line in err.splitlines() if not line.startswith(("INFO", "WARNING"))),
                    *[p.replace("BUSY", port) for p in pieces])


@needs_serve
def test_serve_on_sigint_shuts_down_without_a_traceback(tiny_llama):
    proc = _popen(["serve", "--model", str(tiny_llama), "--kv-cache-mb", "8", "--port", "0", "--log-level", "warning"])
    try:
        _wait_for(proc.stdout, " at http://")
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "Traceback" not in err and proc.returncode in (0, 130), err[-2000:]


@pytest.mark.parametrize("argv", [
    ["generate", "Hi", "--mode", "sequential"],
    ["bench", "speedup", "--annotator", "sot", "--responses", "x.json", "--out", "o"],
    ["generate", "Hi", "--fork-threshold", "0"],
])
def test_fork_threshold_where_it_cannot_apply_is_one_line(tiny_llama, capsys, argv):
    """--fork-threshold is refused before any model loads where nothing samples in pasta mode (a
    replay, a sequential generate), and out of (0, 1] everywhere; and where the model has no tag
    tokens (the tiny preset's), the engine refuses it naming fork_threshold."""
    extra = [] if "--fork-threshold" in argv else ["--fork-threshold", "0.3"]
    code = main([*argv, *extra, "--model", str(tiny_llama), "--kv-cache-mb", "8"])
    _, err = capsys.readouterr()
    assert code == 2
    _one_error_line(err, "fork")
    code = main(["generate", "Hi", "--fork-threshold", "0.3", "--model", str(tiny_llama), *TINY_RUN])
    _, err = capsys.readouterr()
    assert code == 2
    _one_error_line(err, "fork_threshold", "tag-tokens")


@pytest.mark.parametrize("flag", [["--independent-topics"], ["--fork-headroom-tokens", "64"]])
@pytest.mark.parametrize("argv", [
    ["generate", "Hi", "--mode", "sequential"],
    ["bench", "speedup", "--annotator", "sot", "--responses", "x.json", "--out", "o"],
])
def test_grammar_flags_where_nothing_samples_in_pasta_mode_are_refused(tiny_llama, capsys, argv, flag):
    """--independent-topics and --fork-headroom-tokens act only while the model samples in pasta
    mode: a sequential generate or a replay refuses each by name before any model loads, instead
    of ignoring it."""
    code = main([*argv, *flag, "--model", str(tiny_llama), "--kv-cache-mb", "8"])
    _, err = capsys.readouterr()
    assert code == 2
    _one_error_line(err, flag[0])


@pytest.mark.parametrize("argv, flag", [
    (["generate", "a prompt", "--prompts-file", "p.txt"], "prompt"),
    (["generate", "a prompt", "--limit", "2"], "--limit"),  # one prompt: --limit took nothing from it
    (["generate", "--limit", "2"], "--limit"),
    (["generate", "--mode", "pasta", "--compare-transformers"], "--compare-transformers"),
    (["generate", "--mode", "inline", "--baseline", "base"], "--baseline"),
    (["generate", "--mode", "sequential", "--repeats", "9"], "--repeats"),
    (["replay", "--traces", "t.jsonl", "--warmup", "4"], "--warmup"),
    (["bench", "speedup", "--traces", "t.jsonl", "--out", "o", "--temperature", "1.5"], "--temperature"),
    (["bench", "speedup", "--traces", "t.jsonl", "--out", "o", "--ignore-eos"], "--ignore-eos"),
    # bench annotate: only --annotator model samples, and it counts with the model's tokenizer
    (["bench", "annotate", "--annotator", "sot", "--responses", "r.json", "--out", "t.jsonl", "--temperature", "0.9"],
     "--temperature"),
    (["bench", "annotate", "--annotator", "apar", "--responses", "r.json", "--out", "t.jsonl", "--seed", "7"], "--seed"),
    (["bench", "annotate", "--annotator", "endpoint", "--responses", "r.json", "--out", "t.jsonl", "--max-new-tokens",
      "3", "--endpoint-url", "http://127.0.0.1:9/v1", "--endpoint-model", "m"], "--max-new-tokens"),
    (["bench", "annotate", "--annotator", "model", "--responses", "r.json", "--out", "t.jsonl", "--tokenizer",
      "approx"], "--tokenizer"),
])
def test_a_flag_nothing_reads_in_that_command_or_mode_is_refused_before_any_model_loads(argv, flag, capsys):
    """A flag is honoured or refused, never ignored: these act only in another mode or command."""
    from pasta_engine.entrypoints.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pasta-engine: error: {flag} ") and ("leave it out" in err or "use --mode" in err), err


def test_bench_annotate_takes_the_flags_its_annotator_reads(tmp_path, capsys):
    """The refusals above leave alone what sot reads: --tokenizer (promise lengths)."""
    responses = tmp_path / "r.json"
    responses.write_text(json.dumps([{"instruction": "Tips?", "output": "Tips:\n- Sleep.\n- Walk.\n"}]))
    rc = main(["bench", "annotate", "--annotator", "sot", "--responses", str(responses), "--out",
               str(tmp_path / "t.jsonl"), "--tokenizer", "approx"])
    assert rc == 0, capsys.readouterr().err
    assert "tokens from approx" in capsys.readouterr().err


@pytest.fixture
def nothing_loads(monkeypatch):
    """Fail a command that builds a preset (writes a checkpoint), loads weights or allocates the
    KV cache: the refusals below come before all of it (docs/DESIGN.md section 7)."""
    import pasta_engine.engine.llm_engine as llm_engine
    import pasta_engine.tools.presets as presets
    import pasta_engine.worker.model_runner as model_runner

    def fail(what):
        def call(*a, **k):
            raise AssertionError(f"{what} before the refusal")
        return call

    monkeypatch.setattr(llm_engine, "load_model", fail("the weights loaded"))
    monkeypatch.setattr(presets, "build_checkpoint", fail("a preset was built"))
    monkeypatch.setattr(model_runner, "KVCache", fail("the KV cache was allocated"))


SEQUENTIAL = ["generate", "hi", "--mode", "sequential"]
GREEDY = ["--temperature", "0", "--repetition-penalty", "1"]


@pytest.mark.parametrize("argv, pieces", [
    # CUDA graphs where they cannot run, named by the flag
    (["generate", "hi", "--model", "{tiny}", "--device", "cpu", "--cuda-graphs", "on"],
     ["--cuda-graphs on needs --device cuda"]),
    # a KV budget that holds no page of this checkpoint's (from its config.json), or more than the machine
    (["generate", "hi", "--model", "{big}", "--kv-cache-mb", "1"], ["holds no page", "--kv-cache-mb"]),
    (["generate", "hi", "--model", "{tiny}", "--kv-cache-mb", "99999999"], ["--kv-cache-mb"]),
    # engine settings and --lora-scale before a preset is built
    (["generate", "hi", "--preset", "tiny-llama", "--page-size", "2000"], ["page_size=2000"]),
    (["generate", "hi", "--preset", "tiny-llama", "--max-num-batched-tokens", "5", "--thread-policy", "fcfs",
      "--position-policy", "constant:x"], ["position_policy='constant:x'"]),
    (["generate", "hi", "--preset", "tiny-llama", "--lora-scale", "0.5"], ["--lora-scale 0.5", "--adapter"]),
    (["generate", "hi", "--preset", "tiny-llama", "--adapter", "{tmp}", "--lora-scale", "3"],
     ["--lora-scale", "[0, 1]"]),
    # sampling flags of --annotator model before the model loads
    (["bench", "speedup", "--annotator", "model", "--responses", "{responses}", "--out", "{tmp}/o", "--temperature",
      "-1"], ["temperature=-1"]),
    (["bench", "annotate", "--annotator", "model", "--responses", "{responses}", "--out", "{tmp}/t.jsonl", "--top-p",
      "5"], ["top_p=5"]),
    # --out that is a file
    (["bench", "speedup", "--traces", "{traces}", "--out", "{file}", "--model", "{tiny}"], ["--out", "is a file"]),
    (["bench", "pareto", "--prompts", "{prompts}", "--out", "{file}", "--model", "{tiny}"], ["--out", "is a file"]),
    # an empty prompt is not the sample prompt
    (["generate", "", "--model", "{tiny}"], ["prompt argument", "empty"]),
    (["generate", "  ", "--model", "{tiny}"], ["prompt argument", "empty"]),
    # oracle positions need a trace's true lengths
    (["generate", "hi", "--position-policy", "oracle"], ["--position-policy oracle", "replay"]),
    (["bench", "pareto", "--prompts", "{prompts}", "--out", "{tmp}/o", "--position-policy", "Oracle"],
     ["--position-policy Oracle"]),
    # forks nest only in a dialect that nests them
    (["generate", "hi", "--max-fork-depth", "7"], ["--max-fork-depth 7", "'pasta' dialect", "does not nest"]),
    (["bench", "pareto", "--prompts", "{prompts}", "--out", "{tmp}/o", "--max-fork-depth", "1"],
     ["--max-fork-depth 1"]),
    (["replay", "--traces", "{traces}", "--max-fork-depth", "3"], ["--max-fork-depth 3", "'pasta' dialect"]),
    (["bench", "speedup", "--traces", "{traces}", "--out", "{tmp}/o", "--dialect", "apar", "--max-fork-depth", "3"],
     ["--max-fork-depth 3", "'apar' dialect"]),
    # what acts on forks, in a sequential generate (one thread, no fork)
    ([*SEQUENTIAL, "--position-policy", "none"], ["--position-policy none", "mode 'sequential'"]),
    ([*SEQUENTIAL, "--max-forks", "3"], ["--max-forks 3", "mode 'sequential'"]),
    ([*SEQUENTIAL, "--max-threads", "0"], ["--max-threads 0", "mode 'sequential'"]),
    ([*SEQUENTIAL, "--length-cut", "keep"], ["--length-cut keep", "mode 'sequential'"]),
    ([*SEQUENTIAL, "--no-distinct-topics"], ["--no-distinct-topics", "mode 'sequential'"]),
    ([*SEQUENTIAL, "--no-chunk-clean-end"], ["--no-chunk-clean-end", "mode 'sequential'"]),
    # what acts only on forked threads, in an inline generate (chunks decoded in place)
    (["generate", "hi", "--mode", "inline", "--max-threads", "2"], ["--max-threads 2", "mode 'inline'"]),
    # a grammar knob where the weights are known to have no tag tokens
    (["generate", "hi", "--fork-threshold", "0.5", "--no-adapter"], ["--fork-threshold 0.5", "--no-adapter"]),
    (["generate", "hi", "--independent-topics", "--preset", "tiny-llama"], ["--independent-topics", "--preset"]),
    # transformers' greedy generate of the base checkpoint against an answer it cannot equal
    ([*SEQUENTIAL, "--compare-transformers", *GREEDY], ["--compare-transformers", "adapter", "--no-adapter"]),
    (["generate", "hi", "--mode", "both", "--compare-transformers", *GREEDY], ["--compare-transformers", "--baseline"]),
    ([*SEQUENTIAL, "--compare-transformers", "--no-adapter"], ["--compare-transformers", "--temperature 0.2"]),
    ([*SEQUENTIAL, "--compare-transformers", "--model", "{tiny}", "--temperature", "0"], ["--repetition-penalty 1.1"]),
    ([*SEQUENTIAL, "--compare-transformers", "--model", "{tiny}", *GREEDY, "--ignore-eos"], ["--ignore-eos"]),
])
def test_a_bad_or_unused_flag_is_refused_before_anything_loads(tiny_llama, tmp_path, capsys, nothing_loads, argv,
                                                               pieces):
    """Each is one stderr line naming the flag (or the setting) and its value, exit 2, and
    nothing was built, loaded or allocated first; a flag that acts on nothing is refused, never
    ignored (``generate ""`` answered the sample prompt, ``--max-fork-depth`` in generate and
    the fork flags of a sequential generate did nothing, ``--compare-transformers`` reported
    ``same tokens: False``)."""
    big = tmp_path / "big"  # a config.json whose KV pages are 4 MiB (no weights: nothing may read them)
    big.mkdir()
    config = json.loads((tiny_llama / "config.json").read_text())
    config.update(num_hidden_layers=32, num_key_value_heads=8, num_attention_heads=32, head_dim=128, hidden_size=4096)
    (big / "config.json").write_text(json.dumps(config))
    (tmp_path / "file").write_text("not a folder")
    (tmp_path / "r.json").write_text(json.dumps([{"instruction": "Tips?", "output": "- Sleep.\n- Walk.\n"}]))
    (tmp_path / "t.jsonl").write_text(json.dumps({"prompt": "Tips?", "annotated_response": "Sleep."}) + "\n")
    (tmp_path / "p.txt").write_text("Tips?\n")
    names = dict(tiny=tiny_llama, big=big, tmp=tmp_path, file=tmp_path / "file", responses=tmp_path / "r.json",
                 traces=tmp_path / "t.jsonl", prompts=tmp_path / "p.txt")
    rc = main([a.format(**names) for a in argv])
    _, err = capsys.readouterr()
    assert rc == 2, err
    _one_error_line(err, *pieces)
    assert not (tmp_path / "o").exists() and not (tmp_path / "t.jsonl.tmp").exists()


@pytest.mark.parametrize("argv", [
    ["bench", "pareto", "--prompts", "{prompts}", "--out", "{out}", "--preset", "tiny-llama", "--page-size", "2000"],
    ["bench", "speedup", "--traces", "{traces}", "--out", "{out}", "--preset", "tiny-llama", "--page-size", "2000"],
    ["bench", "speedup", "--annotator", "sot", "--responses", "{responses}", "--out", "{out}", "--model", "{missing}"],
    ["bench", "pareto", "--prompts", "{prompts}", "--out", "{out}", "--model", "{missing}"],
])
def test_a_run_refused_after_making_its_out_folder_leaves_none_behind(tmp_path, capsys, argv):
    """``bench speedup`` and ``bench pareto`` make ``--out`` before the model loads (so a folder
    that cannot be made is named first); a run refused after that (an engine setting, a missing
    model) left the empty folder, and its new parents, behind. A folder the user made stays,
    even empty, and so does one the run wrote into."""
    (tmp_path / "r.json").write_text(json.dumps([{"instruction": "Tips?", "output": "- Sleep.\n- Walk.\n"}]))
    (tmp_path / "t.jsonl").write_text(json.dumps({"prompt": "Tips?", "annotated_response": "Sleep."}) + "\n")
    (tmp_path / "p.txt").write_text("Tips?\n")
    made = tmp_path / "made"
    made.mkdir()
    names = dict(responses=tmp_path / "r.json", traces=tmp_path / "t.jsonl", prompts=tmp_path / "p.txt",
                 missing=tmp_path / "no-model")
    for out in (tmp_path / "new" / "deeper" / "o", made, made / "o"):
        rc = main([a.format(out=out, **names) for a in argv])
        err = capsys.readouterr().err
        assert rc == 2, err
        _one_error_line(err, "pasta-engine: error:")
        assert not (tmp_path / "new").exists() and made.is_dir() and not any(made.iterdir()), out
    kept = made / "kept.txt"
    kept.write_text("x")
    assert main([a.format(out=made, **names) for a in argv]) == 2 and kept.read_text() == "x"


def test_an_interrupted_run_leaves_no_empty_out_folder(tmp_path, capsys, monkeypatch):
    """Ctrl-C (or any failure) after ``--out`` was made and before anything was written into
    it: the folder this run made goes (exit 130)."""
    import pasta_engine.entrypoints.cli as cli

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_engine", interrupted)
    (tmp_path / "p.txt").write_text("Tips?\n")
    out = tmp_path / "o"
    assert main(["bench", "pareto", "--prompts", str(tmp_path / "p.txt"), "--out", str(out)]) == 130
    assert not out.exists()


def test_an_unwritable_output_is_one_line(tmp_path, capsys):
    """An OSError from a file the command writes (here bench annotate's --out, a folder) is one
    line and exit 2, not a traceback."""
    responses = tmp_path / "r.json"
    responses.write_text(json.dumps([{"instruction": "Tips?", "output": "Tips:\n- Sleep.\n- Walk.\n"}]))
    rc = main(["bench", "annotate", "--annotator", "sot", "--responses", str(responses), "--out", str(tmp_path),
               "--tokenizer", "approx"])
    _, err = capsys.readouterr()
    last = err.strip().splitlines()[-1]  # after the progress bar
    assert rc == 2 and "Traceback" not in err and last.startswith("pasta-engine: error:") and str(tmp_path) in last


def test_compare_transformers_matches_a_greedy_base_answer(tiny_llama, capsys):
    """Where the comparison holds (the base weights, greedy, no penalty), transformers' greedy
    generate gives the sequential answer's tokens."""
    rc = main([*SEQUENTIAL, "--compare-transformers", "--model", str(tiny_llama), *GREEDY, "--max-new-tokens", "6",
               "--kv-cache-mb", "8", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    row = json.loads(out.splitlines()[0])
    hf = row["transformers"]
    assert hf["same_tokens"] is True and hf["tokens"] == len(row["sequential"]["token_ids"])


def _fail_if_called(what):
    def call(*a, **k):
        raise AssertionError(f"{what} before the refusal")
    return call


def test_a_resume_with_another_model_or_setting_is_refused_before_any_work(tiny_llama, tmp_path, capsys, monkeypatch):
    """``bench pareto --resume`` and ``bench speedup --resume`` kept the rows another model had
    measured (exit 0, the summary naming the new model over the old model's rows): a row now
    records the model and the settings that change what is measured, and a resume with another
    is refused naming the flag and both values, before the model loads."""
    import shutil
    from pathlib import Path

    import pasta_engine.entrypoints.cli as cli

    other = tmp_path / "other-model"
    shutil.copytree(tiny_llama, other)
    (tmp_path / "p.txt").write_text("Tips?\n")
    (tmp_path / "t.jsonl").write_text(json.dumps({"prompt": "Tips?", "annotated_response": "Sleep."}) + "\n")
    quick = ["--kv-cache-mb", "8", "--repeats", "1", "--warmup", "0", "--no-progress"]
    pareto = ["bench", "pareto", "--prompts", str(tmp_path / "p.txt"), "--out", str(tmp_path / "par"),
              "--max-new-tokens", "4", *quick]
    speedup = ["bench", "speedup", "--traces", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "sp"), *quick]
    for argv in (pareto, speedup):
        assert main([*argv, "--model", str(tiny_llama)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    monkeypatch.setattr(cli, "build_engine", _fail_if_called("the model loaded"))
    for argv, changed, pieces in [
        (pareto, ["--model", str(other)], ["--model", repr(str(tiny_llama.resolve())), repr(str(other.resolve()))]),
        (speedup, ["--model", str(other)], ["--model", repr(str(other.resolve()))]),
        (pareto, ["--model", str(tiny_llama), "--dtype", "bfloat16"], ["--dtype 'float32' there, 'bfloat16' here"]),
        (speedup, ["--model", str(tiny_llama), "--max-threads", "3"], ["--max-threads 16 there, 3 here"]),
        (pareto, ["--preset", "tiny-llama"], ["--preset None there, 'tiny-llama' here"]),
    ]:
        rc = main([*argv, *changed, "--resume"])
        _, err = capsys.readouterr()
        assert rc == 2, err
        _one_error_line(err, "--resume:", "row 1 was measured with other inputs", *pieces)
    for argv in (pareto, speedup):  # what the rows recorded
        row = json.loads((Path(argv[argv.index("--out") + 1]) / "prompts.jsonl").read_text().splitlines()[0])
        assert row["model_inputs"]["--model"] == str(tiny_llama.resolve())


def test_a_refused_speedup_resume_leaves_the_earlier_traces_file(tiny_llama, tmp_path, capsys):
    """``bench speedup --annotator sot --responses R --resume`` wrote the new annotations over
    ``out/traces.jsonl`` and only then refused the resume (the rows were measured from other
    traces), so the traces the kept rows were measured from were lost. The file is now written
    after the checks: a refused resume leaves it byte for byte as the earlier run wrote it."""
    out = tmp_path / "sp"
    argv = ["bench", "speedup", "--annotator", "sot", "--out", str(out), "--model", str(tiny_llama),
            "--kv-cache-mb", "8", "--repeats", "1", "--warmup", "0", "--no-progress"]
    for name, items in [("r1.json", "- Sleep.\n- Walk.\n"), ("r2.json", "- Read.\n- Swim.\n- Cook.\n")]:
        (tmp_path / name).write_text(json.dumps([{"instruction": "Tips?", "output": "Tips:\n" + items}]))
    assert main([*argv, "--responses", str(tmp_path / "r1.json")]) == 0, capsys.readouterr().err
    capsys.readouterr()
    before = (out / "traces.jsonl").read_bytes()
    assert b"Walk" in before
    rc = main([*argv, "--responses", str(tmp_path / "r2.json"), "--resume"])
    _, err = capsys.readouterr()
    assert rc == 2, err
    assert "row 1 was measured with other inputs" in err
    assert (out / "traces.jsonl").read_bytes() == before


def test_bench_annotate_out_is_checked_before_anything_is_annotated(tmp_path, capsys, monkeypatch):
    """``bench annotate --out`` naming a folder annotated every response, then failed with
    ``[Errno 21] Is a directory`` (``--out ""``: ``Is a directory: '.'``), never naming
    ``--out``; it is now refused first, naming it."""
    import pasta_engine.tools.bench as bench

    monkeypatch.setattr(bench, "annotate_rows", _fail_if_called("the responses were annotated"))
    responses = tmp_path / "r.json"
    responses.write_text(json.dumps([{"instruction": "Tips?", "output": "Tips:\n- Sleep.\n- Walk.\n"}]))
    folder = tmp_path / "adir"
    folder.mkdir()
    for out, pieces in [(str(folder), [f"--out {folder} is a folder"]), ("", ["--out", "the current folder"]),
                        (str(responses / "t.jsonl"), ["--out", f"{responses} is a file"])]:
        rc = main(["bench", "annotate", "--annotator", "sot", "--responses", str(responses), "--out", out,
                   "--tokenizer", "approx"])
        _, err = capsys.readouterr()
        assert rc == 2, err
        _one_error_line(err, *pieces)
    assert not any(folder.iterdir())


@pytest.mark.parametrize("extra, flag", [
    (["--device", "cuda"], "--device cuda"),
    (["--kv-cache-mb", "5"], "--kv-cache-mb 5"),
    (["--dtype", "float16"], "--dtype float16"),
    (["--no-prefix-caching"], "--no-prefix-caching"),
    (["--preset-seed", "3"], "--preset-seed 3"),
    (["--no-adapter"], "--no-adapter"),
    (["--tokenizer", "approx"], "--model"),  # --tokenizer picks the tokenizer: --model is read by nothing
])
@pytest.mark.parametrize("annotator", ["sot", "apar"])
def test_bench_annotate_without_a_model_refuses_engine_flags(tiny_llama, tmp_path, capsys, annotator, extra, flag):
    """``bench annotate --annotator sot|apar`` builds no engine, and ignored ``--device cuda``,
    ``--kv-cache-mb 5`` or ``--dtype float16`` (exit 0): a model or engine flag is refused
    there, naming it, except ``--model`` and ``--preset`` when their tokenizer counts."""
    responses = tmp_path / "r.json"
    responses.write_text(json.dumps([{"instruction": "Tips?", "output": "Tips:\n- Sleep.\n- Walk.\n"}]))
    out = tmp_path / "t.jsonl"
    rc = main(["bench", "annotate", "--annotator", annotator, "--responses", str(responses), "--out", str(out),
               "--model", str(tiny_llama), *extra])
    _, err = capsys.readouterr()
    assert rc == 2, err
    _one_error_line(err, f"pasta-engine: error: {flag} ", f"--annotator {annotator}", "leave it out")
    assert not out.exists()


def test_a_prompt_too_long_for_the_context_is_named_before_any_decode(tiny_llama, tmp_path, capsys):
    """A prompt too long for the model's context was found mid-run: ``generate --prompts-file``
    printed prompt 0's answer, then failed without the prompt's index; ``bench speedup`` named
    every trace ``prompt 0`` and left its new ``--out`` folder holding traces.jsonl. Every
    prompt is now checked before the first decode, named by its index, nothing written."""
    long = "word " * 5000  # more tokens than tiny-llama's context of 4096
    (tmp_path / "long.json").write_text(json.dumps(["Say hi.", long]))
    (tmp_path / "r.json").write_text(json.dumps([{"instruction": "Tips?", "output": "- Sleep.\n- Walk.\n"},
                                                 {"instruction": long, "output": "Fine."}]))
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"prompt": p, "annotated_response": "Fine."}) + "\n"
                                              for p in ("Hi.", long)))
    model = ["--model", str(tiny_llama), "--kv-cache-mb", "8"]
    for argv in (["generate", "--prompts-file", str(tmp_path / "long.json"), "--max-new-tokens", "4"],
                 ["generate", "--prompts-file", str(tmp_path / "long.json"), "--max-new-tokens", "4", "--mode", "both"],
                 ["replay", "--traces", str(tmp_path / "t.jsonl")],
                 ["bench", "speedup", "--annotator", "sot", "--responses", str(tmp_path / "r.json"), "--out",
                  str(tmp_path / "new" / "inner")],
                 ["bench", "speedup", "--traces", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "new")],
                 ["bench", "pareto", "--prompts", str(tmp_path / "long.json"), "--max-new-tokens", "4", "--out",
                  str(tmp_path / "new")]):
        rc = main([*argv, *model])
        out, err = capsys.readouterr()
        assert rc == 2, err
        assert out == ""  # no answer of prompt 0 first
        err = "\n".join(line for line in err.splitlines() if not line.startswith("annotating (sot)"))  # its bar
        _one_error_line(err, "prompt 1 has", "context length of 4096")
        assert not (tmp_path / "new").exists()
