"""``alpaca_eval`` on ``bench learned``'s AlpacaEval exports, with an OpenAI-compatible judge
(issue 19 item 6; docs/learning.md, "Judging quality with alpaca_eval").

A real ``pasta-engine serve`` process on a tiny random-weight model is the judge, only to prove
the plumbing: the package's own CLI, the judge config shipped in ``bench/alpaca_eval_judge``, the
client reaching the server through ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` (the server checks the
key), every pair annotated by the judge and the annotations and leaderboard written. Nothing is
downloaded: the reference outputs are a file. A random-weight judge writes noise, so that run
counts any reply as a tie; the shipped parser is checked on a real judge's replies apart.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

JUDGE = Path(__file__).resolve().parents[2] / "bench" / "alpaca_eval_judge"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("alpaca_eval") is None,
                                reason="alpaca_eval is not installed (pip install -e '.[eval]')")


def _judge_config() -> dict:
    import yaml

    return yaml.safe_load((JUDGE / "pasta_judge" / "configs.yaml").read_text())


def test_shipped_judge_config_parses_a_judges_reply():
    from alpaca_eval.completion_parsers import regex_parser

    cfg = _judge_config()["pasta_judge"]
    assert cfg["fn_completions"] == "openai_completions" and "logprobs" not in cfg["completions_kwargs"]
    match = cfg["completion_parser_kwargs"]["outputs_to_match"]
    assert regex_parser("Output (b)", dict(match)) == [2]  # the model outputs win
    assert regex_parser("output (a)", dict(match)) == [1]  # the reference wins
    assert regex_parser("I cannot tell.", dict(match)) == []  # alpaca_eval drops an unparsed reply
    template = (JUDGE / cfg["prompt_template"]).read_text()
    assert all(k in template for k in ("{instruction}", "{output_1}", "{output_2}"))


def _judged(server) -> float:
    """Chat completions the server has finished so far (its Prometheus counter)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
    return sum(s.value for s in fams["pasta:request_success"].samples if s.name == "pasta:request_success_total")


def test_alpaca_eval_judges_bench_learned_exports_through_pasta_engine_serve(server, tmp_path):
    from pasta_engine.tools.bench import export_row

    rows = [("Name a fruit.", "An apple.", "A banana, rich in potassium."),
            ("Give two tips for sleep.", "- Go to bed early.\n- Avoid screens.", "Keep a regular schedule."),
            ("Say hi.", "Hi!", "Hello there.")]
    model = tmp_path / "model_outputs_adapter_pasta.json"  # as bench learned writes them
    model.write_text(json.dumps([export_row(i, a, "pasta", "adapter", "vicuna") for i, a, _ in rows]))
    reference = tmp_path / "model_outputs_base_sequential.json"
    reference.write_text(json.dumps([export_row(i, b, "sequential", "base", "vicuna") for i, _, b in rows]))

    judge = tmp_path / "judge"
    shutil.copytree(JUDGE, judge)
    cfg = _judge_config()
    cfg["pasta_judge"]["completions_kwargs"]["model_name"] = server.model  # what a user sets
    cfg["pasta_judge"]["completion_parser_kwargs"]["outputs_to_match"] = {1.5: "(?s).+"}  # noise: a tie
    import yaml

    (judge / "pasta_judge" / "configs.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "alpaca_eval"
    env = {**os.environ, "OPENAI_CLIENT_CONFIG_PATH": str(judge / "openai_configs.yaml"),
           "OPENAI_BASE_URL": f"{server.url}/v1", "OPENAI_API_KEY": server.api_key,
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("OPENAI_API_BASE", None)
    exe = Path(sys.executable).parent / "alpaca_eval"
    before = _judged(server)
    done = subprocess.run([str(exe), "evaluate", "--model_outputs", str(model), "--reference_outputs", str(reference),
                           "--annotators_config", str(judge / "pasta_judge"), "--fn_metric", "get_winrate",
                           "--sort_by", "win_rate", "--output_path", str(out)],
                          env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    assert _judged(server) - before == len(rows)  # one judge call per pair, each answered by the server

    annotations = json.loads((out / "annotations.json").read_text())
    assert sorted(a["instruction"] for a in annotations) == sorted(i for i, _, _ in rows)
    for a in annotations:
        assert a["annotator"] == "pasta_judge" and a["preference"] == 1.5
        assert {a["generator_1"], a["generator_2"]} == {"pasta-engine-sequential (base)", "pasta-engine-pasta (adapter)"}
        assert isinstance(a["preference_raw_completion"], str) and a["preference_raw_completion"]  # the judge's reply
    board = (out / "leaderboard.csv").read_text().splitlines()
    assert board[0].split(",")[1] == "win_rate" and board[1].startswith("pasta-engine-pasta (adapter),50.0,")
