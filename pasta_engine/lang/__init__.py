"""PASTA-LANG: the dialect interface it implements (:mod:`.dialect`), the tags (:mod:`.tags`),
tokenizing prompts and annotated responses (:mod:`.tokenization`), incremental detokenization
(:mod:`.detokenizer`) and the prompts that teach a model the tags (:mod:`.prompts`). Text only: no
torch, no engine."""

from .dialect import PASTA, Dialect, PastaDialect
from .tags import ASYNC_CLOSE, ASYNC_OPEN, SYNC, clean_text, parse, promise_tag, splice, split_threads, strip_tags

__all__ = ["PASTA", "Dialect", "PastaDialect", "ASYNC_OPEN", "ASYNC_CLOSE", "SYNC", "clean_text", "parse",
           "promise_tag", "splice", "split_threads", "strip_tags"]
