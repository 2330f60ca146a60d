"""Annotated responses several test files replay (importable from any test: pytest puts this
folder, the top conftest.py's, on ``sys.path``)."""

#: Three promises, a sync, and text after the join: forks, joins and a continuation in one trace.
ANNOTATED = (
    "Tips:\n1. "
    '<promise topic="sleep" tokens="30"/><async>Go to bed early.</async>\n2. '
    '<promise topic="screens" tokens="20"/><async>Avoid screens at night.</async>\n'
    "<sync/>\nAlso: "
    '<promise topic="walk" tokens="10"/><async>Walk daily.</async> Done.'
)

#: A Multiverse block whose second path holds a block of its own (nesting depth 2): 2 threads
#: forked at depth 1, 4 with the inner block's.
NESTED_MULTIVERSE = (
    "Intro.\n<Parallel><Goal><Outline>1: a</Outline><Outline>2: b</Outline></Goal>"
    "<Path>\n1: first\n</Path>"
    "<Path>\n2: second <Parallel><Goal><Outline>1: x</Outline><Outline>2: y</Outline></Goal>"
    "<Path>\n1: inner one</Path><Path>\n2: inner two, longer than one</Path>"
    "<Conclusion>inner end</Conclusion></Parallel> after\n</Path>"
    "<Conclusion>\nSo.\n</Conclusion></Parallel>\nBye"
)
