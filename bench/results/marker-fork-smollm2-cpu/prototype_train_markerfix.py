"""Prototype (not shipped): annotations put a list item's fork right after its marker, the space
that follows the marker inside the chunk ("1.<promise .../><async> **Point**: ..."), so the fork
point is a token boundary of the plain text (byte-level BPE puts a space at the start of the next
word: "1." " **" ...; "1. <promise" made the model sample a bare " " first, which it never does
in plain text). Usage: python prototype_train_markerfix.py train sft <args>"""
import re, sys
import pasta_engine.tools.annotate as ann

MOVE = re.compile(r"(?m)^([ \t]*(?:\d{1,9}[.)]|[-*+]))([ \t]+)(<promise [^>]*/>)(<async>)")
orig = ann._render
def _render(*a, **kw):
    return MOVE.sub(r"\1\3\4\2", orig(*a, **kw))
ann._render = _render
sys.argv[0] = "pasta-engine"
from pasta_engine.entrypoints.cli import main
sys.exit(main())
