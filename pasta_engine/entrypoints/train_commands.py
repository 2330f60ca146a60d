"""``pasta-engine train sft | bonbon``: teach a model PASTA-LANG (docs/DESIGN.md section 8).

Data: the AlpacaEval prompts with reference answers (``--prompts``), split by the ``dataset``
field: every subset but ``vicuna`` trains; ``vicuna`` is the evaluation split and is never
trained on.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from ..errors import ParameterError
from .args import _int_at_least, add_endpoint_args, add_run_args, command_line, endpoint_from_args, nonneg_int, \
    positive_int

__all__ = ["add_train_parser", "run_train", "add_learned_parser", "run_learned"]


def _train_rows(args: argparse.Namespace, need_output: bool = False) -> list[Any]:
    """The training rows of ``--prompts`` (every dataset but the evaluation split); a
    ParameterError naming ``--prompts`` for a row that has no dataset (it cannot be told from
    the evaluation split)."""
    from ..tools.traces import read_prompts
    from ..train.data import split_rows

    rows = read_prompts(args.prompts, need_output=need_output)
    try:
        return split_rows(rows, "train")
    except ValueError as e:
        raise ParameterError("prompts", str(args.prompts), message=f"--prompts {args.prompts}: {e}") from None


def _add_io_args(p: argparse.ArgumentParser, prompts_help: str) -> None:
    """``--prompts`` (required; ``prompts_help`` says which rows are used), ``--out``, ``--model``."""
    p.add_argument("--prompts", type=Path, required=True, help=prompts_help)
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--model", default=None, help="base checkpoint (default: the embedded SmolLM2-135M-Instruct)")


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not v > 0 or v != v or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return v


def _add_scale_args(p: argparse.ArgumentParser, checkpointing: bool = False) -> None:
    """``--device``, ``--dtype``, ``--max-memory-gib`` (and ``--gradient-checkpointing``): where the
    weights live and in what precision (pasta_engine.train.scale)."""
    from .args import DTYPES

    g = p.add_argument_group("device and precision")
    g.add_argument("--device", default="cpu",
                   help="cpu (default, as the shipped adapter was trained), cuda, cuda:N or auto (cuda when torch sees "
                   "a GPU); under torchrun each rank takes cuda:LOCAL_RANK")
    g.add_argument("--dtype", choices=DTYPES, default=None,
                   help="the base weights' dtype (default: float32 on CPU, bfloat16 on CUDA); LoRA and tag rows "
                   "train in float32")
    if checkpointing:
        g.add_argument("--gradient-checkpointing", action="store_true",
                       help="keep one tensor per layer and recompute the layer's activations in the backward (about "
                       "a third more compute, a fraction of the activation memory)")
    g.add_argument("--max-memory-gib", type=_positive_float, default=None, metavar="GIB",
                   help="the memory the estimate printed before the run must fit in (default: the GPU's free memory, "
                   "or the CPU's available memory)")


def _device_dtype(args: argparse.Namespace) -> tuple[Any, Any]:
    """``(torch device, torch dtype)`` of ``--device``/``--dtype``; ParameterError naming the flag."""
    from ..train.scale import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    return device, resolve_dtype(args.dtype, device)


def _no_torchrun(command: str) -> None:
    """Refuse ``train COMMAND`` under torchrun (WORLD_SIZE > 1): only ``train sft`` is data parallel."""
    world = os.environ.get("WORLD_SIZE", "1")
    if world not in ("", "1"):
        raise ParameterError("--nproc-per-node", world, message=f"train {command} runs in one process (WORLD_SIZE is "
                             f"{world}): only train sft is data parallel under torchrun")


def _check_engine_memory(args: argparse.Namespace, device: Any, dtype: Any, what: str) -> None:
    """Print (and check) the memory estimate of sampling with the engine: the weights and the
    engine's default KV budget (512 MiB on a CPU, 40% of what the weights leave free on a GPU)."""
    from ..worker.model_runner import default_kv_cache_bytes
    from ..train.common import load_config
    from ..train.scale import ModelShape, check_memory, device_memory, estimate_inference_memory

    shape = ModelShape.from_config(load_config(args.model))
    weights = estimate_inference_memory(shape, dtype, 0).total
    if device.type == "cuda":
        kv = int(0.4 * max(0, device_memory(device)[0] - weights))
    else:
        kv = default_kv_cache_bytes(device)
    flags = ["--dtype bfloat16"] if dtype.itemsize == 4 else []
    print(check_memory(estimate_inference_memory(shape, dtype, kv), device, what, max_memory_gib=args.max_memory_gib,
                       flags=flags + ["--model (a smaller one)"]), file=sys.stderr, flush=True)


def add_train_parser(subparsers: Any) -> None:
    """Add ``train sft | bonbon`` to the ``pasta-engine`` subcommands."""
    t = subparsers.add_parser("train", help="teach a model PASTA-LANG: sft (LoRA on annotated answers), bonbon")
    sub = t.add_subparsers(dest="train_command", required=True)
    s = sub.add_parser(
        "sft", help="LoRA finetuning on AlpacaEval reference answers annotated with PASTA-LANG",
        description="Annotate the training split's reference answers (every subset but vicuna), then finetune a LoRA "
        "adapter with the training forward that sees every token as the engine's pasta-mode replay does. Writes OUT/"
        "adapter (float16, manifest), OUT/checkpoint (resumable), OUT/loss.json and loss.png, OUT/examples.jsonl. "
        "Data parallel: `torchrun --nproc-per-node N -m pasta_engine.entrypoints.cli train sft ...` gives each rank a "
        "share of every optimizer step's --grad-accum examples (the global batch) and sums the gradients (gloo on "
        "CPU, NCCL on CUDA); rank 0 logs, checkpoints and exports; --resume works on any number of ranks.",
    )
    _add_io_args(s, "AlpacaEval JSON with reference answers (e.g. results/gpt4_1106_preview/model_outputs.json)")
    s.add_argument("--annotator", choices=("mixed", "sot", "apar", "independent", "endpoint", "none"), default="mixed",
                   help="how answers get their tags (none: no tag, plain SFT of the writer on the answers; mixed: sot "
                   "where a list forks, apar otherwise; independent: list "
                   "items and paragraphs forked only where they do not lean on the chunks beside them, a sync where "
                   "later text does, topics that say what a chunk covers; endpoint: a larger model behind "
                   "--endpoint-url, prompted with docs/annotation_prompt.md, an annotation kept only when its "
                   "stripped text is the answer)")
    add_endpoint_args(s, "endpoint", "annotates with --annotator endpoint")
    s.add_argument("--system-prompt", default=None, metavar="TEXT",
                   help="the system line the adapter is trained with and the engine runs it with (its manifest records "
                   "it); default: the adapter continued from's, else 'Write independent parts of your answer as "
                   "PASTA-LANG promises.'; '' for none, the chat template's own (the context the base model wrote its "
                   "answers in)")
    s.add_argument("--examples", type=Path, default=None,
                   help="train on these annotated answers (JSONL of TrainExample rows: `train chunks`' or an earlier "
                   "run's OUT/examples.jsonl) instead of annotating --prompts; the filters below still apply")
    s.add_argument("--independence-labels", type=Path, default=None,
                   help="with --annotator independent: a reader's labels of the answers' pieces (JSONL of "
                   "bench/reader_independence.py collect); they decide the labelled pieces, the lexical measure the rest")
    s.add_argument("--max-response-tokens", type=positive_int, default=448,
                   help="answers are cut at a line boundary to at most this many tokens")
    s.add_argument("--drop-long", action="store_true",
                   help="leave out answers longer than --max-response-tokens instead of cutting them (a cut answer "
                   "still teaches its length, and a long writer's answers are then cut by the token budget)")
    s.add_argument("--epochs", type=positive_int, default=2)
    s.add_argument("--lr", type=float, default=2e-4, help="peak learning rate (AdamW, warm-up then cosine)")
    s.add_argument("--grad-accum", type=positive_int, default=8, help="examples per optimizer step")
    s.add_argument("--warmup", type=nonneg_int, default=10, help="optimizer steps of linear learning-rate warm-up")
    s.add_argument("--lora-r", type=positive_int, default=16)
    s.add_argument("--lora-alpha", type=positive_int, default=32)
    s.add_argument("--max-steps", type=positive_int, default=None, help="stop after this many optimizer steps")
    s.add_argument("--save-every", type=positive_int, default=20, help="checkpoint every N optimizer steps")
    s.add_argument("--seed", type=nonneg_int, default=0)
    s.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    s.add_argument("--adapter", type=Path, default=None,
                   help="continue training this adapter folder (e.g. an earlier sft run's OUT/adapter) instead of a "
                   "fresh LoRA; its manifest's stages are kept")
    s.add_argument("--content-loss", choices=("nll", "distill"), default="nll",
                   help="the content tokens' target: nll, the answer's own token (plain SFT); distill, the frozen base "
                   "model's next-token distribution reading the clean answer after the plain prompt, so the adapter "
                   "learns where to fork without changing what it says (tags keep their one-hot target; needs tag "
                   "tokens). Experimental: on answers cut by the token budget it teaches the model not to stop "
                   "(bench/results/distill-smollm2-cpu)")
    s.add_argument("--tag-weight", type=float, default=1.0,
                   help="loss weight of the tokens that open a tag (the fork and sync decisions; a chunk's end is not "
                   "weighted); 1 = plain mean NLL")
    s.add_argument("--min-promises", type=nonneg_int, default=0,
                   help="train only on answers the annotator gave at least this many promises (1 drops the unforked "
                   "ones; 2 keeps the answers with parallel chunks, whose content speedup the model should learn)")
    s.add_argument("--min-content-speedup", type=float, default=0.0,
                   help="train only on annotations whose theoretical content speedup (content tokens / critical path, "
                   "tags as tokens when the model has them) is at least this: the structures the model should learn")
    s.add_argument("--max-decoded-tokens", type=positive_int, default=None, metavar="N",
                   help="train only on annotations that decode to at most N tokens, tags included (counted with the "
                   "tokenizer the adapter will have): the budget the answers are served under, since max_new_tokens "
                   "counts every thread's tokens and tags too; an answer that does not fit teaches a cut answer")
    s.add_argument("--forked-only", action="store_true",
                   help="the same as --min-promises 1 (kept so earlier manifests' commands run unchanged)")
    s.add_argument("--distill-hard-open", type=nonneg_int, default=0, metavar="K",
                   help="with --content-loss distill: the first K content tokens of every chunk keep their one-hot "
                   "target, so a chunk learns to open with what its topic promised (the teacher reads it after its "
                   "siblings, without the topic; distilled there, siblings repeat each other)")
    s.add_argument("--tokens-only", action="store_true",
                   help="with --tag-tokens and no --adapter: train only the tag tokens' rows (the LoRA stays zero), so "
                   "every weight stays the base model's: its content is the base model's wherever no tag is in "
                   "context, and the fork decision is the tag rows read against the base model's hidden states")
    s.add_argument("--end-target", choices=("always", "ended"), default="always",
                   help="where an answer trains its end-of-sequence token: always (the end of every answer, also one cut "
                   "to fit --max-response-tokens or generated up to a token budget: the shipped adapter's recipe, which "
                   "teaches stopping early); ended (only answers that ended by themselves: a cut answer trains no end)")
    s.add_argument("--drop-repeats", action="store_true",
                   help="leave out answers that repeat a whole line (a small model's own answers loop; training on "
                   "them teaches the loop)")
    s.add_argument("--drop-refusals", action="store_true",
                   help="leave out answers that open with an apology or a capability disclaimer (\"I'm sorry ... as "
                   "an AI ...\"; pasta_engine.metrics.opens_with_refusal): training on a small model's declines "
                   "teaches it to decline")
    s.add_argument("--tag-tokens", action="store_true",
                   help="add the PASTA-LANG pieces to the tokenizer as tokens and train their embedding rows (a "
                   "promise costs ~7 tokens instead of ~17; the engine then masks what the grammar forbids); the "
                   "manifest records the added tokens. With --adapter: that adapter must have none (a plain "
                   "writer's, trained with --annotator none), and goes on with them")
    s.add_argument("--example-seeds", action="store_true",
                   help="seed torch's RNG per example (from --seed, the step and its place in the global batch), so "
                   "LoRA dropout draws the same masks however many ranks share a step: one process then gives the "
                   "loss curve of a torchrun run (on by itself with more than one rank; off by default, as the shipped "
                   "adapter was trained)")
    _add_scale_args(s, checkpointing=True)
    add_run_args(s)

    a = sub.add_parser(
        "answers", help="the base model's own answers to the training prompts (an SFT data source)",
        description="Answer every training prompt (every AlpacaEval subset but vicuna) with the base model, sequentially, "
        "batched through the engine, seeded per row; resumable (OUT/answers.jsonl grows per batch). Writes "
        "OUT/answers.json in AlpacaEval's format, which `train sft --prompts` reads.",
    )
    _add_io_args(a, "AlpacaEval JSON with instructions (the training split is used)")
    a.add_argument("--max-new-tokens", type=positive_int, default=320)
    a.add_argument("--temperature", type=float, default=0.2, help="default: the SmolLM2-135M-Instruct model card's")
    a.add_argument("--top-p", type=float, default=0.9, help="default: the SmolLM2-135M-Instruct model card's")
    a.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="CTRL's penalty on tokens already seen (1 = none; 1.1 with --temperature 0 stops a 135M model "
                   "looping)")
    a.add_argument("--batch", type=positive_int, default=32, help="prompts per engine call (the unit of resumption)")
    a.add_argument("--max-running-requests", type=positive_int, default=16, help="requests decoded together")
    a.add_argument("--seed", type=nonneg_int, default=0)
    _add_scale_args(a)
    add_run_args(a)

    c = sub.add_parser(
        "chunks", help="every chunk of the annotated answers rewritten by the base model as its thread sees the answer",
        description="Annotate the base model's answers (train answers), then have the base model write every chunk "
        "again from what its thread will see: the answer before its promise, earlier siblings as their topics, and "
        "the chunk's own opening; it continues to the end of the chunk's line or paragraph (greedy, repetition "
        "penalty). The chunks are then independent of their siblings by construction and in the base model's own "
        "words. Topics become descriptive. Resumable (OUT/examples.jsonl grows per batch); `train sft --examples "
        "OUT/examples.jsonl` trains on it.",
    )
    _add_io_args(c, "the base model's answers (train answers' answers.json; the training split is used)")
    c.add_argument("--annotator", choices=("mixed", "sot", "apar"), default="mixed",
                   help="where the forks go before the rewrite (mixed: sot where a list forks, apar otherwise)")
    c.add_argument("--max-response-tokens", type=positive_int, default=448, help="answers are cut to this many tokens")
    c.add_argument("--max-chunk-tokens", type=positive_int, default=256, help="the most tokens a rewritten chunk takes")
    c.add_argument("--repetition-penalty", type=float, default=1.1, help="CTRL's penalty, as the answers were made")
    c.add_argument("--batch", type=positive_int, default=32, help="answers per engine call (the unit of resumption)")
    c.add_argument("--max-running-requests", type=positive_int, default=64, help="chunks decoded together")
    _add_scale_args(c)
    add_run_args(c)

    b = sub.add_parser(
        "bonbon", help="rounds of BoNBoN preference optimization from an SFT adapter",
        description="Sample N annotated responses per training prompt with the engine (pasta mode, the current adapter), "
        "score each by content speedup (content tokens / critical path) + lambda x quality (a proxy: the base model's mean log-likelihood of the clean "
        "text, penalised for repeated lines), and train on best vs worst with the BoNBoN loss (arXiv 2406.00832). Writes "
        "OUT/round{k}/ (samples, pairs, loss curve, adapter) and OUT/adapter.",
    )
    _add_io_args(b, "AlpacaEval JSON (the training split is used)")
    b.add_argument("--adapter", type=Path, required=True, help="the SFT adapter folder to start from")
    b.add_argument("--n", type=_int_at_least(2), default=4, help="samples per prompt (>= 2; the paper's best-of-n)")
    b.add_argument("--rounds", type=positive_int, default=1)
    b.add_argument("--temperature", type=float, default=0.8)
    b.add_argument("--top-p", type=float, default=0.95)
    b.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="CTRL's penalty on tokens already seen, per thread (1 = none)")
    b.add_argument("--max-new-tokens", type=positive_int, default=320)
    b.add_argument("--max-running-requests", type=positive_int, default=8, help="samples decoded together")
    b.add_argument("--quality-weight", type=float, default=1.0, help="lambda of content speedup + lambda x quality")
    add_endpoint_args(b, "judge", "judges each sample against --judge-reference's answer to the same prompt, in both "
                      "orders (the quality term becomes the sample's win value, 0 to 1, instead of the likelihood proxy)")
    b.add_argument("--judge-reference", type=Path, default=None,
                   help="with --judge-url or --reader: AlpacaEval JSON whose 'output' is the reference answer per "
                   "instruction (e.g. the base model's, train answers' answers.json)")
    b.add_argument("--reader", action="store_true",
                   help="a blind reader judges each sample against --judge-reference's answer (the quality term becomes "
                   "its win value): each round stops after sampling, writing OUT/round{k}/reader/pairs.jsonl and "
                   "pairs_reversed.jsonl for the reader (brief: docs/reader_briefs.md; the key stays in key.json), and "
                   "the same command run again once verdicts.jsonl (and verdicts_reversed.jsonl) are beside them goes "
                   "on from the kept samples; exit status 3 while verdicts are missing")
    b.add_argument("--alpha", type=float, default=0.5, help="weight of the SFT term on the best sample")
    b.add_argument("--lr", type=float, default=5e-5)
    b.add_argument("--seed", type=nonneg_int, default=0)
    b.add_argument("--sample-prompts", type=positive_int, default=48,
                   help="training prompts sampled per round (drawn with --seed)")
    _add_scale_args(b, checkpointing=True)
    add_run_args(b)

    k = sub.add_parser(
        "picks", help="the samples a blind reader preferred, from train bonbon --reader rounds, as SFT examples",
        description="Read finished `train bonbon --reader` rounds (ROUND: OUT/round{k}, its samples.jsonl and the "
        "reader's verdicts in reader/) and write every sample the reader preferred to the reference (win value >= "
        "--min-win, both orders averaged; only answers that ended) as TrainExample JSONL for `train sft --examples`: "
        "rejection sampling on the reader's verdicts.",
    )
    k.add_argument("--round", type=Path, action="append", required=True, dest="rounds", metavar="ROUND",
                   help="a round folder (repeat for several)")
    k.add_argument("--out", type=Path, required=True, help="the JSONL file to write")
    k.add_argument("--min-win", type=float, default=0.75,
                   help="the least win value kept (1 win, 0.5 tie, 0 loss; averaged over the orders read)")


def add_learned_parser(bench_subparsers: Any) -> None:
    """Add ``bench learned`` (the evaluation of a learned adapter) to the ``bench`` subcommands."""
    from .args import add_sampling_args

    p = bench_subparsers.add_parser(
        "learned", help="evaluation split: base model vs learned adapter (forks, speedups, quality proxy, exports)",
        description="On AlpacaEval's vicuna subset (never trained on), greedy, batch 1: the base model sequentially and in "
        "pasta mode, the adapter in pasta mode; the content speedup (theoretical: content tokens / critical path; "
        "realized: the clean text decoded sequentially vs the pasta run), fork rate, tag-token fraction, the end-to-end "
        "speedup with its length ratio and the answers cut by the token budget, the quality proxies side by side (repeated "
        "lines, distinct-2, answers cut by length, empty list items, tag text in the clean output, likelihood), AlpacaEval "
        "model_outputs_*.json (for `alpaca_eval` with any OpenAI-compatible judge). Writes OUT/summary.json, prompts.jsonl, "
        "learned.png.",
    )
    _add_io_args(p, "AlpacaEval JSON (the vicuna rows are used)")
    p.add_argument("--adapter", default="auto", help="adapter folder (default: the shipped one)")
    p.add_argument("--no-base-pasta", action="store_true", help="skip the base model in pasta mode (halves the run)")
    add_sampling_args(p, max_new_tokens=512)
    add_run_args(p, timing=True, resume=True)


def _sft(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """``train sft``: flags checked before any work, then one rank's run (torchrun: every rank's)."""
    if not (args.tag_weight > 0 and math.isfinite(args.tag_weight)):  # inf: every weight NaN, loss NaN
        raise ParameterError("--tag-weight", args.tag_weight, "a finite weight > 0 (1 = plain mean NLL)")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise ParameterError("--lr", args.lr, "a finite learning rate > 0 (0 trains nothing: the adapter stays the base "
                             "model)")
    if args.adapter is not None and not (args.adapter / "adapter_config.json").exists():
        raise ParameterError("--adapter", str(args.adapter), "a folder with adapter_config.json (a peft LoRA adapter)")
    if not (args.min_content_speedup >= 0 and math.isfinite(args.min_content_speedup)):  # inf keeps no answer
        raise ParameterError("--min-content-speedup", args.min_content_speedup,
                             "a finite speedup >= 0 (0 keeps every answer)")
    if args.tokens_only and (not args.tag_tokens or args.adapter is not None):
        raise ParameterError("--tokens-only", True, message=(
            "--tokens-only trains a fresh adapter's tag-token rows: it needs --tag-tokens and no --adapter "
            f"(got {'--adapter ' + str(args.adapter) if args.adapter is not None else 'no --tag-tokens'})"))
    _refuse_unused_sft_flags(args)
    device, dtype = _device_dtype(args)
    from ..train.scale import init_data_parallel

    dp = init_data_parallel(device)
    try:
        return _sft_rank(args, argv, dp, dtype)
    finally:
        dp.close()


def _refuse_unused_sft_flags(args: argparse.Namespace) -> None:
    """Refuse a ``train sft`` flag set where nothing reads it (ParameterError naming it, before
    any model loads; the manifest recorded such flags as if applied): the annotation flags with
    ``--examples`` (its rows are annotated already), the new adapter's shape and tag tokens with
    ``--adapter`` (training goes on from that adapter's; ``--tag-tokens`` only when it has no
    added tokens), ``--distill-hard-open`` without
    ``--content-loss distill``, ``--lora-r`` / ``--lora-alpha`` with ``--tokens-only`` (the LoRA
    matrices stay frozen at zero), ``--forked-only`` with ``--min-promises`` (it is
    ``--min-promises 1``, which the larger count overrides)."""
    from ..models.adapter import added_tokens, read_manifest

    defaults = _sft_defaults()
    unused = []
    if args.examples is not None:
        unused += [(f, f"--examples {args.examples} holds annotated examples already")
                   for f in ("annotator", "independence_labels", "max_response_tokens", "drop_long")
                   + tuple(k for k in defaults if k.startswith("endpoint"))]
    if args.adapter is not None:
        unused += [(f, f"training goes on from --adapter {args.adapter}, with its own shape")
                   for f in ("lora_r", "lora_alpha")]
        if added_tokens(read_manifest(args.adapter)):
            unused.append(("tag_tokens", f"--adapter {args.adapter} has its added tokens already"))
    if args.tokens_only:
        unused += [(f, "--tokens-only trains the tag tokens' rows alone; the LoRA matrices stay frozen at zero")
                   for f in ("lora_r", "lora_alpha")]
    if args.min_promises >= 1:
        unused.append(("forked_only", f"it is --min-promises 1, and --min-promises {args.min_promises} is given"))
    if args.content_loss != "distill":
        unused.append(("distill_hard_open", f"acts only with --content-loss distill (this run: {args.content_loss})"))
    for name, why in unused:
        if name in defaults and getattr(args, name, defaults[name]) != defaults[name]:
            flag = "--" + name.replace("_", "-")
            raise ParameterError(flag, getattr(args, name), message=f"{flag} {getattr(args, name)}: {why}; leave it out")


def _sft_defaults() -> dict[str, Any]:
    """The default value of every ``train sft`` flag (from the parser itself)."""
    p = argparse.ArgumentParser()
    add_train_parser(p.add_subparsers(dest="command"))
    return vars(p.parse_args(["train", "sft", "--prompts", "-", "--out", "-"]))


def _sft_rank(args: argparse.Namespace, argv: Sequence[str] | None, dp: Any, dtype: Any) -> int:
    """``train sft`` on rank ``dp`` (every rank builds the same examples; rank 0 writes and prints)."""
    from ..lang.tags import strip_tags
    from ..tools.bench import count_tokens_fn
    from ..train.common import LoraSettings, base_manifest, load_tokenizer
    from ..train.data import EVAL_DATASET, build_examples
    from ..train.sft import SFTSettings, train_sft

    rows = _train_rows(args, need_output=True)
    if args.limit is not None:
        rows = rows[: args.limit]
    tokenizer = load_tokenizer(args.model)
    count = count_tokens_fn(tokenizer)
    labels = None
    if args.independence_labels is not None:
        if args.annotator != "independent":
            raise ParameterError("--independence-labels", str(args.independence_labels),
                                 message="--independence-labels needs --annotator independent")
        try:
            lines = args.independence_labels.read_text().splitlines()
            labels = {row["instruction"]: row for row in (json.loads(x) for x in lines if x.strip())}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ParameterError("--independence-labels", str(args.independence_labels),
                                 message=f"cannot read {args.independence_labels} as labels JSONL "
                                 f"(bench/reader_independence.py collect): {e}") from None
    endpoint = endpoint_from_args(args, "endpoint")
    if (endpoint is not None) != (args.annotator == "endpoint"):
        raise ParameterError("--annotator", args.annotator, message="--annotator endpoint goes with --endpoint-url and "
                             "--endpoint-model, and they with it")
    annotate_fn = None
    if endpoint is not None:
        from ..tools.annotate_endpoint import endpoint_annotator

        annotate_fn = endpoint_annotator(endpoint, count)
    if args.examples is not None:
        examples, counts = _read_examples(args, {r.instruction for r in rows})
    else:
        examples, counts = build_examples(rows, count, max_response_tokens=args.max_response_tokens,
                                          annotator=args.annotator, seed=args.seed, independence_labels=labels,
                                          annotate_fn=annotate_fn, drop_long=args.drop_long)
    if args.drop_repeats:
        from ..train.quality import repeated_line_fraction

        examples = [e for e in examples if repeated_line_fraction(strip_tags(e.annotated)) == 0]
        counts["without_repeated_lines"] = len(examples)
    if args.drop_refusals:
        from ..metrics import opens_with_refusal

        examples = [e for e in examples if not opens_with_refusal(strip_tags(e.annotated))]
        counts["without_refusals"] = len(examples)
    min_promises = max(args.min_promises, 1 if args.forked_only else 0)
    if min_promises:
        examples = [e for e in examples if e.promises >= min_promises]
        counts[f"min_promises_{min_promises}"] = len(examples)
    if args.min_content_speedup > 0 or args.max_decoded_tokens is not None:
        examples = _annotation_filters(examples, args, tokenizer, counts)
    if dp.is_main:
        args.out.mkdir(parents=True, exist_ok=True)
        with (args.out / "examples.jsonl").open("w") as f:
            f.writelines(json.dumps(e.to_dict()) + "\n" for e in examples)
        print(f"train sft: {counts['kept']} examples from {len(rows)} training rows ({counts['forked']} forked; never "
              f"{EVAL_DATASET!r}); {counts}" + (f"; {dp.world_size} ranks ({dp.backend})" if dp.world_size > 1 else ""),
              file=sys.stderr)
    prompt_kw = {}
    if args.system_prompt is not None:
        from ..lang.prompts import PastaPrompt

        prompt_kw["pasta_prompt"] = PastaPrompt(system=args.system_prompt, examples=())
    elif args.adapter is not None:
        from ..lang.prompts import PastaPrompt

        from ..models.adapter import read_manifest

        earlier = (read_manifest(args.adapter) or {}).get("pasta_prompt")
        if earlier is not None:
            prompt_kw["pasta_prompt"] = PastaPrompt.from_dict(earlier)
    settings = SFTSettings(epochs=args.epochs, lr=args.lr, grad_accum=args.grad_accum, seed=args.seed, warmup=args.warmup,
                           max_steps=args.max_steps, save_every=args.save_every,
                           lora=LoraSettings(r=args.lora_r, alpha=args.lora_alpha), tag_weight=args.tag_weight,
                           init_adapter=str(args.adapter) if args.adapter is not None else None,
                           tag_tokens=args.tag_tokens, content_loss=args.content_loss, end_target=args.end_target,
                           distill_hard_open=args.distill_hard_open, tokens_only=args.tokens_only,
                           device=args.device, dtype=str(dtype).replace("torch.", ""),
                           gradient_checkpointing=args.gradient_checkpointing, example_seeds=args.example_seeds,
                           **prompt_kw)
    manifest = base_manifest(args.model, command_line(argv))
    manifest["data"] = {"prompts_file": str(args.prompts), "split": f"every dataset but {EVAL_DATASET}",
                        "annotator": (sorted({e.annotator for e in examples}) if args.examples is not None else
                                      args.annotator if endpoint is None else f"endpoint: {endpoint.name}"),
                        "max_response_tokens": args.max_response_tokens, "drop_long": args.drop_long,
                        "independence_labels": None if labels is None else str(args.independence_labels), **counts}
    summary = train_sft(examples, args.out, settings, base=args.model, resume=args.resume, manifest=manifest,
                        data_parallel=dp, max_memory_gib=args.max_memory_gib)
    if dp.is_main:
        print(f"train sft: {summary['optimizer_steps']} steps in {summary['train_seconds']:.0f} s; loss "
              f"{summary['first_loss']:.3f} -> {summary['last_loss']:.3f}", file=sys.stderr)
        print(f"wrote {args.out / 'adapter'}, {args.out / 'loss.json'}, {args.out / 'loss.png'}")
    return 0


def _read_examples(args: argparse.Namespace, training: set[str]) -> tuple[list[Any], dict[str, int]]:
    """``--examples``: the TrainExample rows of a JSONL file, shuffled with ``--seed``. Raises
    ParameterError naming the flag for an unreadable file, a malformed row, or a prompt that is
    not a training row of ``--prompts`` (the evaluation split is never trained on)."""
    import random

    from ..train.data import EVAL_DATASET, TrainExample

    fields = set(TrainExample.__dataclass_fields__)
    try:
        rows = [json.loads(x) for x in args.examples.read_text(encoding="utf-8").splitlines() if x.strip()]
        examples = [TrainExample(**{k: v for k, v in r.items() if k in fields}) for r in rows]
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise ParameterError("--examples", str(args.examples), message=f"--examples: cannot read {args.examples} as TrainExample "
                             f"JSONL (prompt, annotated, dataset, annotator, promises, response_tokens, ended): {e}") from None
    for e in examples:
        if e.dataset == EVAL_DATASET or e.prompt not in training:
            raise ParameterError("--examples", str(args.examples), message=f"--examples {args.examples} holds a prompt that is not "
                                 f"a training row of {args.prompts} ({e.prompt[:60]!r}, dataset {e.dataset!r}); "
                                 f"{EVAL_DATASET!r} is never trained on")
    random.Random(args.seed).shuffle(examples)
    return examples, {"rows": len(examples), "kept": len(examples), "forked": sum(e.promises > 0 for e in examples),
                      "ended": sum(e.ended for e in examples), "examples_file": str(args.examples)}


def _annotation_filters(examples: Sequence[Any], args: argparse.Namespace, tokenizer: Any,
                        counts: dict[str, Any]) -> list[Any]:
    """The examples that pass ``--min-content-speedup`` (theoretical content speedup at least
    that) and ``--max-decoded-tokens`` (at most that many tokens sampled, tags and every thread
    included), each recorded in ``counts`` with the examples left after it. Tokens are counted
    as the trained model will decode them: ``tokenizer`` (the base model's) gets, in place, the
    ``--adapter``'s added tag tokens or, with ``--tag-tokens``, the PASTA-LANG pieces."""
    from ..lang.grammar import add_tag_tokens
    from ..lang.tokenization import eos_token_ids, replay_eos_id
    from ..models.loader import add_adapter_tokens
    from ..train.data import annotation_content_speedup, annotation_decoded_tokens

    if args.adapter is not None:
        add_adapter_tokens(tokenizer, args.adapter)
    if args.tag_tokens:  # a fresh adapter's, or a tokenless --adapter's (refused when it has them)
        add_tag_tokens(tokenizer)
    eos = replay_eos_id(tokenizer, eos_token_ids(tokenizer))
    kept = list(examples)
    if args.min_content_speedup > 0:
        kept = [e for e in kept if annotation_content_speedup(tokenizer, e.annotated, eos) >= args.min_content_speedup]
        counts[f"min_content_speedup_{args.min_content_speedup:g}"] = len(kept)
    if args.max_decoded_tokens is not None:
        kept = [e for e in kept if annotation_decoded_tokens(tokenizer, e.annotated, eos) <= args.max_decoded_tokens]
        counts[f"max_decoded_tokens_{args.max_decoded_tokens}"] = len(kept)
    return kept


def _judge_references(path: Path, prompts: Sequence[str]) -> dict[str, str]:
    """``--judge-reference``'s answers as prompt -> reference answer (AlpacaEval JSON with an
    ``output`` per instruction). Raises ParameterError naming the flag when a sampled prompt has
    no answer there."""
    from ..tools.traces import read_prompts

    refs = {r.instruction: r.output for r in read_prompts(path, need_output=True)}
    missing = [p for p in prompts if p not in refs]
    if missing:
        raise ParameterError("--judge-reference", str(path),
                             message=f"--judge-reference {path} has no answer to {len(missing)} of the "
                             f"{len(prompts)} sampled prompts (first: {missing[0][:60]!r})")
    return refs


def _bonbon(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    import random

    from ..train.bonbon import BonbonSettings, train_bonbon

    from ..config import SamplingParams

    SamplingParams(temperature=args.temperature, top_p=args.top_p,
                   repetition_penalty=args.repetition_penalty)  # ParameterError names a bad flag value
    # checked before a round is sampled (the loss and AdamW refused them only after, unnamed)
    if not 0.0 <= args.alpha <= 1.0:
        raise ParameterError("alpha", args.alpha, message=f"--alpha {args.alpha}: the SFT term's weight must be in [0, 1]")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise ParameterError("lr", args.lr, message=f"--lr {args.lr}: the learning rate must be a finite number > 0")
    if not math.isfinite(args.quality_weight):
        raise ParameterError("quality_weight", args.quality_weight,
                             message=f"--quality-weight {args.quality_weight}: expected a finite number")
    _no_torchrun("bonbon")
    device, dtype = _device_dtype(args)
    rows = _train_rows(args)
    if args.limit is not None:
        rows = rows[: args.limit]
    prompts = [r.instruction for r in random.Random(args.seed).sample(rows, min(args.sample_prompts, len(rows)))]
    settings = BonbonSettings(n=args.n, rounds=args.rounds, temperature=args.temperature, top_p=args.top_p,
                              repetition_penalty=args.repetition_penalty,
                              max_running_requests=args.max_running_requests, max_new_tokens=args.max_new_tokens, quality_weight=args.quality_weight, alpha=args.alpha,
                              lr=args.lr, seed=args.seed, device=args.device,
                              dtype=str(dtype).replace("torch.", ""),
                              gradient_checkpointing=args.gradient_checkpointing)
    judge = endpoint_from_args(args, "judge")
    scorer = None
    reader_refs = None
    if args.reader:
        if judge is not None:
            raise ParameterError("--reader", True, message="--reader and --judge-url are two judges: give one")
        if args.judge_reference is None:
            raise ParameterError("--judge-reference", None,
                                 message="--judge-reference is missing: --reader judges each sample against it")
        reader_refs = _judge_references(args.judge_reference, prompts)
    elif (judge is None) != (args.judge_reference is None):
        flag = "--judge-reference" if judge is not None else "--judge-url"
        raise ParameterError(flag, None, message=f"{flag} is missing: a judge needs --judge-url, --judge-model and "
                             "--judge-reference together")
    if judge is not None:
        from ..tools.judge import JudgeQuality

        scorer = JudgeQuality(judge, _judge_references(args.judge_reference, prompts))
    from ..train.bonbon import ReaderVerdictsPending

    try:
        summary = train_bonbon(prompts, args.adapter, args.out, settings, base=args.model, scorer=scorer,
                               reader_references=reader_refs,
                               manifest={"bonbon_command": command_line(argv),
                                         **({"judge": judge.name} if judge is not None else {}),
                                         **({"judge": "a blind reader"} if reader_refs is not None else {})},
                               max_memory_gib=args.max_memory_gib)
    except ReaderVerdictsPending as e:
        print(f"train bonbon: {e}", file=sys.stderr)
        return 3
    if scorer is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with (args.out / "judge_verdicts.jsonl").open("a") as f:
            f.writelines(json.dumps(v) + "\n" for v in scorer.verdicts)
    for r in summary["rounds"]:
        print(f"train bonbon round {r['round']}: {r['pairs']} pairs of {r['samples']} samples; mean content speedup "
              f"{r['mean_content_speedup']:.2f}, margin {r['first_margin']:.2f} -> {r['last_margin']:.2f}",
              file=sys.stderr)
    print(f"wrote {args.out / 'adapter'}")
    return 0


def _answers(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    from ..config import SamplingParams
    from ..engine.llm_engine import Engine
    from ..train.answers import check_answers_resume, generate_answers
    from ..train.data import EVAL_DATASET

    SamplingParams(temperature=args.temperature, top_p=args.top_p,
                   repetition_penalty=args.repetition_penalty)  # ParameterError names a bad flag value
    _no_torchrun("answers")
    device, dtype = _device_dtype(args)
    rows = _train_rows(args)
    if args.limit is not None:
        rows = rows[: args.limit]
    check_answers_resume(args.out, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                         repetition_penalty=args.repetition_penalty, seed=args.seed,
                         generator=str(args.model or "SmolLM2-135M-Instruct"))  # before the model loads
    _check_engine_memory(args, device, dtype, "train answers")
    engine = Engine.from_pretrained(args.model, device=device, dtype=dtype, adapter=None,
                                    max_running_requests=args.max_running_requests)
    summary = generate_answers(engine, rows, args.out, max_new_tokens=args.max_new_tokens,
                               temperature=args.temperature, top_p=args.top_p,
                               repetition_penalty=args.repetition_penalty, batch=args.batch, seed=args.seed,
                               generator=str(args.model or "SmolLM2-135M-Instruct"))
    summary["command"] = command_line(argv)
    summary["device"], summary["dtype"] = str(device), str(dtype).replace("torch.", "")
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"train answers: {summary['answers']} answers to {summary['rows']} training prompts (never "
          f"{EVAL_DATASET!r}); {summary['length_cut']} cut at {args.max_new_tokens} tokens", file=sys.stderr)
    print(f"wrote {args.out / 'answers.json'}")
    return 0


def _chunks(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    from ..config import SamplingParams
    from ..engine.llm_engine import Engine
    from ..tools.annotate_independent import document_frequencies
    from ..tools.bench import count_tokens_fn
    from ..train.data import EVAL_DATASET, build_examples
    from ..train.thread_chunks import check_chunks_resume, rewrite_chunks

    SamplingParams(repetition_penalty=args.repetition_penalty)  # ParameterError names a bad flag value
    _no_torchrun("chunks")
    device, dtype = _device_dtype(args)
    rows = _train_rows(args, need_output=True)
    # word weights from every training answer: a --limit trial writes the topics the full run writes
    idf = document_frequencies(r.output for r in rows if r.output)
    if args.limit is not None:
        rows = rows[: args.limit]
    check_chunks_resume(args.out, repetition_penalty=args.repetition_penalty, max_new_tokens=args.max_chunk_tokens,
                        model=str(args.model or "SmolLM2-135M-Instruct"), annotator=args.annotator,
                        max_response_tokens=args.max_response_tokens)  # before the model loads
    _check_engine_memory(args, device, dtype, "train chunks")
    engine = Engine.from_pretrained(args.model, device=device, dtype=dtype, adapter=None,
                                    max_running_requests=args.max_running_requests)
    count = count_tokens_fn(engine.tokenizer)
    examples, counts = build_examples(rows, count, max_response_tokens=args.max_response_tokens,
                                      annotator=args.annotator)
    _, chunk_counts = rewrite_chunks(engine, examples, args.out, count_tokens=count, idf=idf,
                                     repetition_penalty=args.repetition_penalty, max_new_tokens=args.max_chunk_tokens,
                                     batch=args.batch, model=str(args.model or "SmolLM2-135M-Instruct"),
                                     annotator=args.annotator, max_response_tokens=args.max_response_tokens)
    summary = {**chunk_counts, "annotation": counts, "command": command_line(argv)}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"train chunks: {chunk_counts['answers']} answers (never {EVAL_DATASET!r}); chunks rewritten "
          f"{chunk_counts['stop']} to their end, {chunk_counts['cut']} cut at a sentence end, "
          f"{chunk_counts['original']} kept", file=sys.stderr)
    print(f"wrote {args.out / 'examples.jsonl'}")
    return 0


def _picks(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """``train picks``: the reader-preferred samples of ``--round`` folders as TrainExample JSONL."""
    from ..train.bonbon import ReaderVerdictsPending, read_round_picks

    if not 0.0 < args.min_win <= 1.0:
        raise ParameterError("--min-win", args.min_win, "a win value in (0, 1] (1 win, 0.5 tie, 0 loss)")
    picks = []
    for folder in args.rounds:
        try:
            found = read_round_picks(folder, args.min_win)
        except (FileNotFoundError, ReaderVerdictsPending) as e:
            raise ParameterError("--round", str(folder), message=f"--round {folder}: {e}") from None
        print(f"train picks: {len(found)} samples from {folder} (win value >= {args.min_win:g}, "
              f"{sum(e.promises > 0 for e in found)} forked)", file=sys.stderr)
        picks.extend(found)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        f.writelines(json.dumps(e.to_dict()) + "\n" for e in picks)
    print(f"wrote {args.out} ({len(picks)} examples)")
    return 0


def run_train(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """Run the ``train`` subcommand in ``args``. Returns the exit status."""
    commands = {"sft": _sft, "bonbon": _bonbon, "answers": _answers, "chunks": _chunks, "picks": _picks}
    return commands[args.train_command](args, argv)


def run_learned(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """``bench learned``: see :mod:`pasta_engine.train.evaluate`. Returns the exit status."""
    import torch

    from ..engine.llm_engine import Engine
    from ..tools.bench import device_name, run_info
    from ..tools.traces import read_prompts
    from ..train.common import load_base
    from ..train.data import split_rows
    from ..train.evaluate import evaluate_learned, format_quality_proxies
    from ..train.quality import LikelihoodQuality
    from .args import sampling_params

    prompts = split_rows(read_prompts(args.prompts), "eval")
    if not prompts:
        raise ParameterError("prompts", str(args.prompts), message=f"--prompts {args.prompts}: no row of the "
                             "evaluation split (dataset 'vicuna'): bench learned evaluates on those only")
    if args.limit is not None:
        prompts = prompts[: args.limit]
    params = sampling_params(args)
    base = Engine.from_pretrained(args.model, adapter=None, max_running_requests=1)
    adapter = Engine.from_pretrained(args.model, adapter=args.adapter, max_running_requests=1)
    if adapter.adapter is None:
        raise ValueError("bench learned needs an adapter: none is shipped for this model, pass --adapter PATH")
    hf, tok, _ = load_base(args.model)
    hf.eval()
    settings = {**run_info(command_line(argv)), "model": str(args.model or "embedded SmolLM2-135M-Instruct"),
                "adapter": str(adapter.adapter), "adapter_manifest": adapter.adapter_manifest,
                "device_name": device_name("cpu"), "torch_version": torch.__version__, "dtype": "float32",
                "max_new_tokens": params.max_new_tokens, "temperature": params.temperature, "top_p": params.top_p,
                "repetition_penalty": params.repetition_penalty, "batch_size": 1,
                "split": "vicuna (evaluation split, never trained on)", "repeats": args.repeats,
                "warmup": args.warmup,
                "torch_threads": torch.get_num_threads(), "load_average": list(os.getloadavg())}
    result = evaluate_learned(prompts, base, adapter, LikelihoodQuality(hf, tok), args.out, settings, params,
                              repeats=args.repeats, warmup=args.warmup, base_pasta=not args.no_base_pasta,
                              resume=args.resume,
                              model=str(Path(args.model).expanduser().resolve()) if args.model else None)
    s = result["summary"]
    a = s["adapter_pasta"]
    def x(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.2f}"

    print(f"bench learned: {s['prompts']} prompts; adapter: geomean content speedup {x(a['geomean_content_speedup'])}x "
          f"theoretical, {x(a['geomean_realized_content_speedup'])}x realized (clean text sequential / pasta), forked on "
          f"{a['forked']} ({a['fork_rate']:.0%}), tag tokens {a['tag_token_fraction']:.0%} of those decoded; end to end "
          f"{x(s['geomean_end_to_end_speedup'])}x vs the base model sequential, length ratio "
          f"{x(s['geomean_length_ratio'])}, cut by the token budget {s['cut_fraction_base_sequential']:.0%} base / "
          f"{s['cut_fraction_adapter_pasta']:.0%} adapter; quality proxy base {s['base_sequential']['mean_quality']:.3f} "
          f"vs adapter {a['mean_quality']:.3f}", file=sys.stderr)
    spread = (a.get("timing") or {}).get("geomean_realized_content_speedup_spread")
    if spread:
        print(f"bench learned: realized content speedup over {args.repeats} runs per side: {spread['min']:.2f}x / "
              f"{spread['median']:.2f}x / {spread['max']:.2f}x (geomean of each prompt's min / median / max)",
              file=sys.stderr)
    print(f"bench learned: {format_quality_proxies(s['quality_proxies'])}", file=sys.stderr)
    for w in a.get("warnings", []):
        print(f"pasta-engine: warning: {w}", file=sys.stderr)
    print(f"wrote {args.out / 'summary.json'}, {args.out / 'prompts.jsonl'}, {args.out / 'learned.png'}")
    return 0
