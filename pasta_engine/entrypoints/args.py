"""Command-line flags shared by every command that builds an engine, and the engine they build.

One definition per flag: ``generate``, ``replay`` and ``bench`` (and later ``serve``) add the
groups they need with :func:`add_model_args`, :func:`add_pasta_args`, :func:`add_sampling_args`
and :func:`add_run_args`, so help texts and checks never drift apart. Counts are checked by
argparse itself (``--kv-cache-mb 0`` or ``--limit -1`` is a one-line usage error).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any, Sequence

from ..config import THREAD_POLICIES
from ..layers.backends import backend_info, backend_names
from ..tools.presets import PRESETS

#: ``--warmup``'s default: untimed runs of each side before ``--mode both`` times anything.
DEFAULT_WARMUP = 1

__all__ = [
    "positive_int",
    "tcp_port",
    "nonneg_int",
    "add_model_args",
    "add_pasta_args",
    "add_sampling_args",
    "add_run_args",
    "add_baseline_arg",
    "build_engine",
    "cpu_threads",
    "adapter_choice",
    "loads_adapter",
    "sampling_params",
    "command_line",
    "DTYPES",
]

DTYPES = ("float32", "float16", "bfloat16")


def _int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {v}")
        return v

    parse.__name__ = f"integer >= {lo}"
    return parse


#: argparse type: an integer >= 1.
positive_int = _int_at_least(1)
#: argparse type: an integer >= 0.
nonneg_int = _int_at_least(0)


def tcp_port(text: str) -> int:
    """argparse type: a TCP port, an integer from 0 (any free port) to 65535 (checked while the
    flags are parsed, before any model loads)."""
    v = nonneg_int(text)
    if v > 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port from 0 to 65535, got {v}")
    return v


# The CPU thread policy lives with the engine (Engine.from_pretrained applies it); the CLI's
# --threads flag passes through to it.
from ..worker.cpu_threads import AUTO_THREADS_MAX, AUTO_THREADS_POLICY, MAX_THREADS, busy_cores, cpu_threads  # noqa: E402,F401


def _threads_flag(text: str) -> str | int:
    if text == "auto":
        return text
    try:
        n = positive_int(text)
    except argparse.ArgumentTypeError:
        n = 0
    if not 1 <= n <= MAX_THREADS:
        raise argparse.ArgumentTypeError(f"expected auto or an integer from 1 to {MAX_THREADS}, got {text!r}")
    return n


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Which model, where, and the engine's memory and kernels."""
    g = p.add_argument_group("model and engine")
    m = g.add_mutually_exclusive_group()
    m.add_argument("--model", default=None,
                   help="local HF checkpoint dir or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    m.add_argument("--preset", default=None, choices=sorted(PRESETS), metavar="NAME",
                   help="random-weight checkpoint at a published shape, built once into the cache: "
                   + ", ".join(sorted(PRESETS)))
    g.add_argument("--preset-seed", type=nonneg_int, default=0, help="seed of the preset's random weights")
    g.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto: cuda when torch sees a GPU, "
                   "else cpu)")
    g.add_argument("--dtype", choices=DTYPES, default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    g.add_argument("--attention-backend", default="torch", choices=backend_names(),
                   help="; ".join(f"{n}: {backend_info(n).summary}" for n in backend_names()))
    g.add_argument("--cuda-graphs", choices=("auto", "on", "off"), default="auto",
                   help="replay captured decode steps (auto: on with --device cuda and the triton backend)")
    g.add_argument("--kv-cache-mb", type=positive_int, default=None,
                   help="KV cache budget in MiB (default: 512 on CPU, 40%% of free GPU memory on CUDA)")
    g.add_argument("--page-size", type=positive_int, default=16, help="KV page size in tokens")
    g.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="prefill every prompt in full (default: a prompt reuses the cached KV pages of a prefix seen "
                   "before, such as the chat template and the PASTA-LANG system prompt; outputs are the same)")
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                   help="token budget: tokens forwarded in one step; a longer prompt is prefilled in pieces while "
                   "other requests keep decoding (chunked prefill; default: no limit)")
    g.add_argument("--thread-policy", choices=THREAD_POLICIES, default=THREAD_POLICIES[0],
                   help="which threads run when --max-num-batched-tokens binds: critical_first (default: every running "
                   "request's main thread, or the child with the longest promise left while the main thread waits at a "
                   "sync, before any extra child thread; extra threads round-robin across requests, so no request "
                   "starves) or fcfs (requests in admission order, each taking the budget for all its threads; the "
                   "policy before it). Outputs are the same")
    g.add_argument("--tensor-parallel-size", type=positive_int, default=1, metavar="N",
                   help="shard the model over N ranks, one process each (torch.distributed: gloo on CPU, NCCL on "
                   "CUDA; N must divide the KV heads; default: 1)")
    g.add_argument("--threads", type=_threads_flag, default="auto", metavar="auto|N",
                   help="torch CPU threads (--device cpu): N, or auto (default): "
                   f"{AUTO_THREADS_POLICY} (see docs/measuring.md, 'CPU threads')")
    a = g.add_mutually_exclusive_group()
    a.add_argument("--adapter", type=Path, default=None,
                   help="a LoRA adapter folder (peft format) merged into the weights (default: the adapter shipped for "
                   "the embedded model, in pasta mode)")
    a.add_argument("--no-adapter", action="store_true", help="run the base model's weights, no adapter")
    g.add_argument("--lora-scale", type=float, default=None, metavar="S",
                   help="merge S (0 to 1) of the adapter's low-rank deltas: lower values move the weights toward the "
                   "base model's (fewer, narrower forks; answers closer to the base model's); default: the adapter "
                   "manifest's, else 1")


def add_pasta_args(p: argparse.ArgumentParser) -> None:
    """How far PASTA's threads may go (each flag's default is kept in ``pasta_defaults``, so a
    command or mode where a flag acts on nothing can refuse it when set)."""
    g = p.add_argument_group("PASTA")
    added = [
        g.add_argument("--position-policy", default="predicted",
                       help="predicted | constant:K | none | oracle (replay only)"),
        g.add_argument("--max-threads", type=nonneg_int, default=16,
                       help="threads of one request decoding together (0 = unlimited)"),
        g.add_argument("--max-forks", type=nonneg_int, default=64, help="forks per request; later promises are text"),
        g.add_argument("--max-fork-depth", type=positive_int, default=2,
                       help="how deep forks nest in a dialect that nests them (replay and bench speedup --dialect "
                            "multiverse): a thread at depth d forks only when d < this; deeper blocks decode inline"),
    ]
    g.add_argument("--fork-threshold", type=float, default=None,
                   help="the fork knob of a learned model, a probability in (0, 1]: the main thread opens a promise "
                        "exactly where the promise token's probability is at least this (lower forks more, faster; "
                        "default: the model decides as it samples); applies to pasta-mode generation with a model "
                        "that has the tag tokens")
    added += [
        g.add_argument("--length-cut", choices=("prefix", "keep"), default="prefix",
                       help="when --max-new-tokens runs out with chunks unfinished: prefix ends the text where the "
                            "first unfinished chunk stopped (no hole mid-answer); keep gives every thread's text"),
        g.add_argument("--distinct-topics", action=argparse.BooleanOptionalAction, default=True,
                       help="a promise's topic may not repeat one already promised in the response (a model with the "
                            "tag tokens; default on)"),
        g.add_argument("--chunk-clean-end", action=argparse.BooleanOptionalAction, default=True,
                       help="a chunk may not end empty or at a colon, comma or semicolon, and one at its cap "
                            "mid-sentence gets up to 32 more tokens to end it (a model with the tag tokens; default "
                            "on)"),
    ]
    g.add_argument("--independent-topics", action=argparse.BooleanOptionalAction, default=False,
                   help="a promise's topic may not open with a word that leans on what came before (Another, "
                        "Furthermore, This, Finally, ...; a model with the tag tokens; default off: faster, more "
                        "independent chunks, not read better)")
    g.add_argument("--fork-headroom-tokens", type=nonneg_int, default=None, metavar="N",
                   help="the main thread opens a promise only while the tokens left under --max-new-tokens cover "
                        "what the running chunks were promised and have not written, plus N (fewer answers cut by "
                        "the budget; a model with the tag tokens; default off)")
    # the defaults of the flags in `added` (the grammar knobs' are Limits.GRAMMAR_KNOBS)
    p.set_defaults(pasta_defaults={a.dest: a.default for a in added})


def add_sampling_args(p: argparse.ArgumentParser, max_new_tokens: int = 256, *, temperature: float = 0.0,
                      top_p: float = 1.0, repetition_penalty: float | None = 1.0) -> None:
    """How tokens are picked (see :class:`pasta_engine.config.SamplingParams`); the keyword
    arguments are the flags' defaults, and ``repetition_penalty=None`` leaves that flag and
    ``--ignore-eos`` out (``serve``: per-request fields there, not server-wide defaults)."""
    g = p.add_argument_group("sampling")
    added = [
        g.add_argument("--max-new-tokens", type=positive_int, default=max_new_tokens,
                       help="tokens a response may hold, all threads together"),
        g.add_argument("--temperature", type=float, default=temperature,
                       help=f"0 (or below 1e-5) = greedy (default: {temperature:g})"),
        g.add_argument("--top-p", type=float, default=top_p, help=f"(default: {top_p:g})"),
        g.add_argument("--top-k", type=nonneg_int, default=0, help="0 = all tokens"),
    ]
    if repetition_penalty is not None:
        added += [
            g.add_argument("--repetition-penalty", type=float, default=repetition_penalty,
                           help="CTRL's penalty on tokens already seen, per thread (1 = none; default: "
                           f"{repetition_penalty:g})"),
            g.add_argument("--ignore-eos", action="store_true",
                           help="never sample end-of-sequence: every response runs to --max-new-tokens (vLLM's "
                           "ignore_eos, for fixed-length benchmarks)"),
        ]
    added.append(g.add_argument("--seed", type=nonneg_int, default=0))
    # each flag's default, so a command where sampling does not happen can refuse one that was set
    p.set_defaults(sampling_defaults={a.dest: a.default for a in added})


def add_run_args(p: argparse.ArgumentParser, timing: bool = False, resume: bool | None = None,
                 progress: bool = False) -> None:
    """Which inputs, and (``timing``) how the modes' runs are warmed up and repeated (and, with
    ``resume``, default ``timing``, resumed); ``progress``: ``--no-progress``."""
    from ..tools.bench import DEFAULT_REPEATS

    g = p.add_argument_group("run")
    g.add_argument("--limit", type=positive_int, default=None, help="use only the first N prompts")
    if timing:
        g.add_argument("--warmup", type=nonneg_int, default=DEFAULT_WARMUP,
                       help="untimed runs in each mode before timing (of the first prompt; bench speedup: also of the "
                       "trace with the most promises)")
        g.add_argument("--repeats", type=positive_int, default=DEFAULT_REPEATS,
                       help="timed runs per prompt and mode, interleaved: the fastest of each mode counts; the spread "
                       "(min/median/max of the wall times and of the per-run realized speedups) is reported beside it "
                       f"(default: {DEFAULT_REPEATS})")
    if resume if resume is not None else timing:
        g.add_argument("--resume", action="store_true",
                       help="keep the rows already in OUT/prompts.jsonl (same prompts, same order) and run the rest")
    if progress:
        g.add_argument("--no-progress", action="store_true",
                       help="no progress bar (default: a bar with tokens/s on stderr when there is more than one prompt)")


def add_baseline_arg(p: argparse.ArgumentParser) -> None:
    """``--baseline``: whose weights answer in sequential mode."""
    p.add_argument("--baseline", choices=("same", "base"), default="same",
                   help="the weights of the sequential answers: same (default: the pasta mode's weights, the adapter "
                   "when one is loaded, as the server's mode=sequential; the content comparison) or base (the base "
                   "model's weights without the adapter: the end-to-end comparison against the base model, reported "
                   "with the length ratio and the answers cut by the token budget)")


def add_endpoint_args(p: argparse.ArgumentParser, prefix: str, role: str) -> None:
    """``--PREFIX-url`` and ``--PREFIX-model``: a model behind an OpenAI-compatible endpoint that
    does ``role`` (the key comes from $PASTA_ENDPOINT_API_KEY or $OPENAI_API_KEY)."""
    p.add_argument(f"--{prefix}-url", default=None, metavar="URL",
                   help=f"the OpenAI-compatible API root of the model that {role}, e.g. http://127.0.0.1:8000/v1 "
                   "(OpenAI, vLLM, SGLang or pasta-engine serve; API key from $PASTA_ENDPOINT_API_KEY or $OPENAI_API_KEY)")
    p.add_argument(f"--{prefix}-model", default=None, metavar="NAME", help=f"the model name at --{prefix}-url")


def endpoint_from_args(args: argparse.Namespace, prefix: str) -> Any:
    """The :class:`~pasta_engine.tools.endpoint.ChatEndpoint` of ``--PREFIX-url``/``--PREFIX-model``,
    or None when neither is given. Raises ParameterError naming the flag that is missing or bad."""
    from ..errors import ParameterError
    from ..tools.endpoint import ChatEndpoint

    attr = prefix.replace("-", "_")
    url, model = getattr(args, f"{attr}_url"), getattr(args, f"{attr}_model")
    if url is None and model is None:
        return None
    if url is None or model is None:
        missing = f"--{prefix}-url" if url is None else f"--{prefix}-model"
        raise ParameterError(missing, None, message=f"{missing} is missing: --{prefix}-url and --{prefix}-model go "
                             "together")
    try:
        return ChatEndpoint(url, model)
    except ParameterError as e:
        flag = f"--{prefix}-url" if e.param == "base_url" else f"--{prefix}-model"
        raise ParameterError(flag, e.value, message=f"{flag}: {e}") from None


def command_line(argv: Sequence[str] | None) -> str:
    """The command as typed (for records)."""
    return "pasta-engine " + shlex.join(list(sys.argv[1:] if argv is None else argv))


def sampling_params(args: argparse.Namespace) -> Any:
    """:class:`~pasta_engine.config.SamplingParams` from the sampling flags (raises
    ParameterError naming a bad one)."""
    from ..config import SamplingParams

    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed,
                          repetition_penalty=getattr(args, "repetition_penalty", 1.0),
                          ignore_eos=getattr(args, "ignore_eos", False))


def _dtype_name(args: argparse.Namespace) -> str:
    from ..engine.llm_engine import check_device

    return args.dtype or ("bfloat16" if check_device(args.device).type == "cuda" else "float32")


def adapter_choice(args: argparse.Namespace, mode: str = "pasta") -> Any:
    """What ``Engine.from_pretrained(adapter=...)`` gets for ``mode``: ``--adapter PATH``, None
    with ``--no-adapter``, else the shipped adapter (``"auto"``): the same weights in both modes,
    as the server's ``mode`` does; only ``--baseline base`` gives the sequential mode the base
    model's weights (None)."""
    if mode == "sequential" and getattr(args, "baseline", "same") == "base":
        return None
    if getattr(args, "no_adapter", False):
        return None
    if getattr(args, "adapter", None) is not None:
        return args.adapter
    return "auto"


def loads_adapter(args: argparse.Namespace, choice: Any) -> bool:
    """Whether an engine built with ``adapter=choice`` (:func:`adapter_choice`) merges an
    adapter: a path does; ``"auto"`` only for the embedded model (no ``--model`` or
    ``--preset``) when the package ships its adapter. Known before anything loads."""
    if choice is None:
        return False
    if choice != "auto":
        return True
    from ..models.adapter import shipped_adapter

    return args.model is None and not args.preset and shipped_adapter() is not None


def build_engine(args: argparse.Namespace, max_running_requests: int = 1, adapter: Any = "auto"
                 ) -> tuple[Any, dict[str, Any]]:
    """The engine the flags describe and the settings to record. The device, the engine's
    settings (:class:`~pasta_engine.config.EngineConfig`, :class:`~pasta_engine.config.Limits`)
    and ``--lora-scale`` are checked first, before a preset is built (written to disk) or
    anything loads. ``adapter``: see :func:`adapter_choice` (``--adapter`` and ``--no-adapter``
    win over the default ``"auto"``; None, the base weights, stays None). On a CPU, torch's
    thread count is set from ``--threads`` (:func:`cpu_threads`).

    Raises what :meth:`Engine.from_pretrained` raises (FileNotFoundError,
    UnsupportedModelError, ParameterError), naming the problem."""
    import torch

    from ..config import EngineConfig, Limits
    from ..engine.llm_engine import Engine, check_device
    from ..errors import ParameterError
    from ..models.adapter import check_lora_scale
    from ..models.loader import EMBEDDED_MODEL
    from ..tools.bench import device_name

    device = check_device(args.device)
    dtype_name = _dtype_name(args)
    options: dict[str, Any] = dict(
        attention_backend=args.attention_backend, max_running_requests=max_running_requests,
        cuda_graphs={"auto": None, "on": True, "off": False}[args.cuda_graphs], page_size=args.page_size,
        enable_prefix_caching=getattr(args, "prefix_caching", True),
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        max_num_batched_tokens=getattr(args, "max_num_batched_tokens", None),
        thread_policy=getattr(args, "thread_policy", THREAD_POLICIES[0]),
    )
    if hasattr(args, "max_threads"):
        options["limits"] = Limits(max_threads=args.max_threads or None, max_forks=args.max_forks,
                                   max_fork_depth=args.max_fork_depth,
                                   fork_threshold=getattr(args, "fork_threshold", None),
                                   length_cut=getattr(args, "length_cut", "prefix"),
                                   distinct_topics=getattr(args, "distinct_topics", True),
                                   chunk_clean_end=getattr(args, "chunk_clean_end", True),
                                   independent_topics=getattr(args, "independent_topics", False),
                                   fork_headroom_tokens=getattr(args, "fork_headroom_tokens", None))
        options["position_policy"] = args.position_policy
    if args.kv_cache_mb is not None:
        options["kv_cache_bytes"] = args.kv_cache_mb * 2**20
    if adapter == "auto":
        adapter = adapter_choice(args)  # the flags win over the caller's default
    lora_scale = getattr(args, "lora_scale", None)
    if lora_scale is not None and getattr(args, "no_adapter", False):
        raise ParameterError("lora_scale", lora_scale, message=f"--lora-scale {lora_scale} scales an adapter, but "
                             "--no-adapter loads none: drop one of the two")
    if lora_scale is not None:
        try:
            check_lora_scale(lora_scale)
        except ParameterError as e:
            raise ParameterError("--lora-scale", lora_scale, message=f"--lora-scale: {e}") from None
        if lora_scale != 1.0 and not loads_adapter(args, adapter_choice(args)):
            raise ParameterError("--lora-scale", lora_scale, message=f"--lora-scale {lora_scale} scales an adapter, "
                                 "and this run loads none (--model or --preset without --adapter): add --adapter "
                                 "PATH or drop --lora-scale")
    EngineConfig.from_kwargs(**options)  # every setting checked before a preset is built or anything loads
    if args.preset:
        from ..tools.presets import build_checkpoint

        path: Any = build_checkpoint(args.preset, seed=args.preset_seed, dtype=getattr(torch, dtype_name))
        label = f"preset {args.preset} (random weights, seed {args.preset_seed})"
    elif args.model:
        path, label = args.model, str(args.model)
    else:
        path, label = None, f"embedded {EMBEDDED_MODEL}"
    engine = Engine.from_pretrained(path, device=device, dtype=getattr(torch, dtype_name), adapter=adapter,
                                    threads=getattr(args, "threads", "auto"),
                                    lora_scale=lora_scale if adapter is not None else None, **options)
    threads = engine.cpu_threads
    settings = {
        "model": label,
        "model_path": None if path is None else str(path),
        "preset": args.preset,
        "device": str(device),
        "device_name": device_name(str(device)),
        "dtype": dtype_name,
        "torch_version": torch.__version__,
        "weight_bytes": engine.model.weight_bytes,
        "adapter": None if engine.adapter is None else str(engine.adapter),
        "lora_scale": engine.lora_scale if engine.adapter is not None else None,
        "cpu_threads": threads,
        "cpu_threads_flag": getattr(args, "threads", "auto") if threads is not None else None,
        "prefix_caching": engine.config.enable_prefix_caching,
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "thread_policy": engine.config.thread_policy,
        **engine.model_runner.describe(),
    }
    if hasattr(args, "max_threads"):
        settings.update(position_policy=str(engine.config.position_policy), max_threads=args.max_threads or None,
                        max_forks=args.max_forks, max_fork_depth=args.max_fork_depth,
                        fork_threshold=getattr(args, "fork_threshold", None))
    return engine, settings


def api_key_problem(api_key: object) -> str | None:
    """Why no client could ever send ``api_key`` (None when one can): it is empty, or it holds
    whitespace or control characters, which an ``Authorization`` header cannot carry intact (a
    header value loses its surrounding whitespace)."""
    if not isinstance(api_key, str) or not api_key.strip():
        return "the API key is empty: give a non-empty key, or none to serve without one"
    if any(c.isspace() or not c.isprintable() for c in api_key):
        return ("the API key holds whitespace or control characters, which an Authorization header cannot carry "
                "intact (no request could match it): give it without them")
    return None
