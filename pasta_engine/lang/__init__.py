"""The languages a model writes its parallel structure in: the dialect protocol, its events and
the registry (:mod:`.dialect`), the dialects (PASTA-LANG :mod:`.pasta`, whose tags are
:mod:`.tags`; APAR :mod:`.apar`; Multiverse :mod:`.multiverse`), tokenizing prompts and annotated
responses (:mod:`.tokenization`), incremental detokenization (:mod:`.detokenizer`) and the prompts
that teach a model the tags (:mod:`.prompts`). Text only: no torch, no engine."""

from .dialect import Dialect
from .pasta import PASTA, PastaDialect
from .tags import ASYNC_CLOSE, ASYNC_OPEN, SYNC, clean_text, parse, promise_tag, splice, split_threads, strip_tags

__all__ = ["PASTA", "Dialect", "PastaDialect", "ASYNC_OPEN", "ASYNC_CLOSE", "SYNC", "clean_text", "parse",
           "promise_tag", "splice", "split_threads", "strip_tags"]
