"""The clean text a stream shows after each piece of an annotated text, for any dialect's parser:
the harness of the streaming tests in tests/lang/ (test_tags.py, test_dialect_rejoin.py)."""

from __future__ import annotations

from pasta_engine.lang.dialect import Malformed, Text
from pasta_engine.lang.tags import drop_empty_items


def streamed_cleans(parser, pieces, rejoin=None):
    """Feed ``pieces`` to ``parser`` (an incremental parser: ``feed``, ``finish``); return the
    clean text after each piece as a stream shows it (``drop_empty_items(final=False)`` over the
    parser's text so far, what may still change held back) and the final clean text. ``rejoin``:
    the dialect's rule (None: PASTA-LANG's)."""
    text, drops, shown = "", [], []

    def take(items):
        nonlocal text
        for e in items:
            if type(e) is Text:
                text += e.text
            elif not isinstance(e, Malformed):
                drops.append(len(text))

    for piece in pieces:
        take(parser.feed(piece))
        shown.append(drop_empty_items(text, drops, final=False, rejoin=rejoin))
    take(parser.finish())
    return shown, drop_empty_items(text, drops, final=True, rejoin=rejoin)
