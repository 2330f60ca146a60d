"""``train answers`` resumes a folder only under the flags it was sampled with, and answers again
the rows that failed (finish_reason ``error``)."""

import json
from types import SimpleNamespace

import pytest

from pasta_engine.errors import ParameterError
from pasta_engine.tools.traces import PromptRow
from pasta_engine.train.answers import generate_answers

ROWS = [PromptRow("Name a colour.", dataset="oasst"), PromptRow("Say a number.", dataset="koala")]


class FakeEngine:
    """Answers each prompt with ``answer: <prompt>``; ``fail`` names prompts that end in error."""

    def __init__(self, fail=()):
        self.fail, self.asked = set(fail), []

    def generate(self, prompts, params, mode):
        self.asked += prompts
        return [SimpleNamespace(text="" if p in self.fail else f"answer: {p}",
                                stats=SimpleNamespace(finish_reason="error" if p in self.fail else "stop",
                                                      tokens_decoded=0 if p in self.fail else 3))
                for p in prompts]


def test_a_resume_under_other_sampling_flags_is_refused(tmp_path):
    """A rerun with other flags kept the first run's answers and recorded the new flags."""
    generate_answers(FakeEngine(), ROWS, tmp_path, max_new_tokens=6, temperature=1.5, top_p=1.0, seed=3,
                     progress=False)
    kept = json.loads((tmp_path / "sampling.json").read_text())
    assert kept["max_new_tokens"] == 6 and kept["temperature"] == 1.5 and kept["seed"] == 3
    with pytest.raises(ParameterError, match="--max-new-tokens 6 then, 40 now.*--temperature") as e:
        generate_answers(FakeEngine(), ROWS, tmp_path, max_new_tokens=40, temperature=0.0, top_p=1.0, seed=3,
                         repetition_penalty=1.0, progress=False)
    assert e.value.param == "--max-new-tokens" and "new --out" in str(e.value)
    with pytest.raises(ParameterError, match="--model"):
        generate_answers(FakeEngine(), ROWS, tmp_path, max_new_tokens=6, temperature=1.5, top_p=1.0, seed=3,
                         generator="other-model", progress=False)
    # the same flags go on from the kept answers (nothing asked again)
    again = FakeEngine()
    s = generate_answers(again, ROWS, tmp_path, max_new_tokens=6, temperature=1.5, top_p=1.0, seed=3, progress=False)
    assert again.asked == [] and s["answers"] == 2


def test_a_resume_answers_the_rows_that_failed_again(tmp_path):
    """Rows written with finish_reason "error" were never retried."""
    first = generate_answers(FakeEngine(fail={"Say a number."}), ROWS, tmp_path, progress=False)
    assert first["errors"] == 1
    again = FakeEngine()
    s = generate_answers(again, ROWS, tmp_path, progress=False)
    assert again.asked == ["Say a number."] and s["errors"] == 0
    answers = json.loads((tmp_path / "answers.json").read_text())
    assert [a["output"] for a in answers] == ["answer: Name a colour.", "answer: Say a number."]
