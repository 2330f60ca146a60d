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

#: The training tests' trace: several promises, a sync that waits for a chunk still running, a
#: chunk that ends after the sync point, text after the sync, and a fork after the join.
SLEEP_TIPS = (
    "Tips:\n1. "
    '<promise topic="sleep" tokens="30"/><async>Go to bed early, and get up at the same time every day.</async>\n2. '
    '<promise topic="screens" tokens="20"/><async>Avoid screens.</async>\n'
    "<sync/>\nAlso: "
    '<promise topic="walk" tokens="10"/><async>Walk daily.</async> Done.'
)
#: The prompt the training tests pair with :data:`SLEEP_TIPS`.
SLEEP_PROMPT = "Give me sleep tips."

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
