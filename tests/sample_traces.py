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
