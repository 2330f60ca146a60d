"""BoNBoN's reader scores join verdicts only to the samples their pairs were written for."""

from __future__ import annotations

import pytest

from pasta_engine.train.bonbon import ReaderVerdictsPending, reader_scores


def _rows(prompts, texts):
    return [{"prompt": p, "text": t, "content_speedup": 1.2, "quality": -1.0} for p, t in zip(prompts, texts)]


def test_pairs_written_for_other_samples_are_refused(tmp_path):
    """A round sampled again (another --n or --limit) kept reader/ as it was, and the old
    verdicts landed on the new samples by position (some for another prompt)."""
    refs = {"sleep": "Sleep eight hours.", "tips": "Drink water."}
    first = _rows(["sleep", "tips"], ["a", "b"])
    with pytest.raises(ReaderVerdictsPending):  # the first call writes the pairs
        reader_scores(first, refs, tmp_path / "reader", 0, 1.0)
    with pytest.raises(ReaderVerdictsPending):  # the same samples: still waiting for verdicts
        reader_scores(first, refs, tmp_path / "reader", 0, 1.0)
    for other in (_rows(["sleep", "sleep", "tips"], ["a", "c", "b"]), _rows(["tips", "sleep"], ["b", "a"]),
                  _rows(["sleep", "tips"], ["a", "another answer"])):
        with pytest.raises(ValueError, match="remove .*reader to write pairs for this round's samples"):
            reader_scores(other, refs, tmp_path / "reader", 0, 1.0)
