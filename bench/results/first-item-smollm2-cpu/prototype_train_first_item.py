"""Prototype (not shipped): `pasta-engine train sft` with annotations that keep a list's first item
on the main thread (written in sequence) and fork only the items after it, as
`FIRST_ITEM=sequential` does in ../base-plan-smollm2-cpu/prototype_base_plan.py (lists of three or
more items; shorter lists are not forked). With `--annotator sot` only lists fork. Usage:
python prototype_train_first_item.py train sft <args>"""
import sys

import pasta_engine.tools.annotate as ann

_list_forks = ann._list_forks
ann._list_forks = lambda response, unit, count, min_tokens: [
    f for f in _list_forks(response, unit, count, min_tokens)
    if len(unit.items) >= 3 and f.start != unit.items[0].fork_start]
sys.argv[0] = "pasta-engine"
from pasta_engine.entrypoints.cli import main  # noqa: E402

sys.exit(main())
