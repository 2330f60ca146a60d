"""Entry points: the ``pasta-engine`` command line (and the flags every command shares)."""
