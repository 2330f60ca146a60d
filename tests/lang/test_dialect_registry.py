"""The dialect protocol kept small and explicit (issue 32, item 4): one registry maps a name to
its dialect and refuses an unknown one, naming the parameter, the value and the known names;
every registered dialect has every member the engine reads (the protocol's, and the base class's
with their defaults), so nothing in the engine probes for one; a dialect missing a member is
refused when it is registered, naming the member; PASTA-LANG is a dialect like the others."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import pasta_engine
from pasta_engine.config import Limits
from pasta_engine.lang import apar, dialect as dialect_mod, multiverse, pasta, tags
from pasta_engine.lang.dialect import (DIALECT_MEMBERS, DIALECT_NAMES, AsyncClose, AsyncOpen, BaseDialect, Dialect,
                                       Promise, Sync, as_dialect, dialect_prompt, get_dialect, register_dialect)
from pasta_engine.lang.pasta import PASTA, PastaDialect
from pasta_engine.lang.prompts import DEFAULT_PASTA_PROMPT, NO_PROMPT

#: What the protocol asks of every dialect, and what the base class gives a default for.
PROTOCOL = ("name", "open_tag", "close_tag", "nesting", "parser", "parse", "grammar_state", "child_cap",
            "reserved_positions", "split_threads", "splice", "clean_text")
DEFAULTED = ("fork_joins", "join_tag", "branches", "join_position", "inserted_bytes", "split_tree", "prompt", "rejoin")

SAMPLES = {
    "pasta": '1. <promise topic="a" tokens="10"/><async>x</async>\n<sync/>done',
    "apar": "1. a[Fork][Child] x[/Child]\ndone",
    "multiverse": "<Parallel><Goal><Outline>1: a</Outline></Goal><Path>\n1: x</Path><Conclusion>done</Conclusion>"
                  "</Parallel>",
}


@pytest.fixture
def registry(monkeypatch):
    """The registry, restored after the test."""
    monkeypatch.setattr(dialect_mod, "_REGISTRY", dict(dialect_mod._REGISTRY))
    return dialect_mod._REGISTRY


def complete_members(name: str) -> dict:
    """Every protocol member, PASTA-LANG's, under another name."""
    members = {m: PastaDialect.__dict__[m] for m in PROTOCOL if m != "name"}
    members["name"] = name
    return members


# --------------------------------------------------------------------------- the registry


def test_the_registry_lists_every_dialect_and_each_name_gives_its_dialect():
    assert DIALECT_NAMES == ("pasta", "apar", "multiverse")
    assert [get_dialect(n) for n in DIALECT_NAMES] == [PASTA, apar.APAR, multiverse.MULTIVERSE]
    for name in DIALECT_NAMES:
        assert get_dialect(name).name == name and get_dialect(name) is get_dialect(name)
    # every dialect class of the package is registered: none is reachable only by importing its module
    shipped = {cls for module in (pasta, apar, multiverse) for cls in vars(module).values()
               if inspect.isclass(cls) and issubclass(cls, BaseDialect) and cls is not BaseDialect}
    assert shipped == {type(get_dialect(n)) for n in DIALECT_NAMES}


@pytest.mark.parametrize("value", ["klingon", "", "PASTA", " pasta", 3, None])
def test_an_unknown_name_is_refused_naming_the_parameter_the_value_and_the_known_names(value):
    with pytest.raises(ValueError) as e:
        get_dialect(value)
    msg = str(e.value)
    assert f"dialect={value!r}" in msg
    assert all(repr(n) in msg for n in DIALECT_NAMES), msg


def test_a_registered_dialect_is_known_by_name_and_a_name_is_not_taken_twice(registry):
    toy = type("ToyRegistered", (BaseDialect,), complete_members("toy-registered"))()
    assert register_dialect(toy) is toy and register_dialect(toy) is toy  # the same object again: no change
    assert get_dialect("toy-registered") is toy
    with pytest.raises(ValueError, match="'toy-registered'") as e:
        get_dialect("toy-unregistered")
    assert "'pasta'" in str(e.value)
    other = type("ToyRegistered", (BaseDialect,), complete_members("toy-registered"))()
    with pytest.raises(ValueError, match="'toy-registered' is registered already"):
        register_dialect(other)
    with pytest.raises(ValueError, match="'pasta' is registered already"):
        register_dialect(PastaDialect())  # PASTA-LANG's name holds PASTA
    assert get_dialect("toy-registered") is toy and get_dialect("pasta") is PASTA


# --------------------------------------------------------------------------- the members


def test_the_protocol_and_the_base_class_declare_every_member_once():
    assert DIALECT_MEMBERS == PROTOCOL
    base = [m for m in vars(BaseDialect) if not m.startswith("_")]
    assert sorted(base) == sorted(DEFAULTED)
    assert not set(PROTOCOL) & set(DEFAULTED)


@pytest.mark.parametrize("name", DIALECT_NAMES)
def test_each_registered_dialect_has_every_member_without_probing(name):
    d = get_dialect(name)
    assert isinstance(d, Dialect) and isinstance(d, BaseDialect) and as_dialect(d) is d
    for member in PROTOCOL + DEFAULTED:
        inspect.getattr_static(d, member)  # a real attribute or method of the dialect: no fallback needed
    items = d.parse(SAMPLES[name])
    fork = next(e for e in items if isinstance(e, Promise))
    branches = d.branches(fork)
    assert branches and all(isinstance(p, Promise) and isinstance(text, str) and text for p, text in branches)
    assert isinstance(d.fork_joins, bool) and isinstance(d.join_tag, str)
    assert d.join_position(5, [9]) in (5, 9) and d.inserted_bytes(Limits()) >= 0
    assert d.prompt(DEFAULT_PASTA_PROMPT).system  # each teaches its own language
    assert d.clean_text(SAMPLES[name]).rstrip().endswith("done")


def test_nothing_in_the_package_probes_a_dialect_for_a_member():
    """No ``getattr(dialect, "join_tag", ...)``/``hasattr(dialect, "branches")``: every member is
    declared, on the protocol or on the base class with its default."""
    members = "|".join(PROTOCOL + DEFAULTED)
    probe = re.compile(rf"""\b(?:getattr|hasattr)\(\s*[\w.]*(?:dialect|lang|PASTA|APAR|MULTIVERSE)\w*\s*,\s*["']"""
                       rf"""(?:{members})["']""", re.IGNORECASE)
    root = Path(pasta_engine.__file__).parent
    hits = [f"{p.relative_to(root)}: {m.group(0)}" for p in sorted(root.rglob("*.py"))
            for m in probe.finditer(p.read_text())]
    assert hits == []


@pytest.mark.parametrize("missing", PROTOCOL)
def test_a_dialect_class_missing_a_member_is_refused_at_registration_naming_it(registry, missing):
    members = complete_members("incomplete")
    del members[missing]
    cls = type("Incomplete", (BaseDialect,), members)
    with pytest.raises(TypeError) as e:
        register_dialect(cls())
    assert f"'{missing}'" in str(e.value) and "Incomplete" in str(e.value)
    assert "incomplete" not in registry
    with pytest.raises(TypeError, match=f"'{missing}'"):
        as_dialect(type("ProtocolOnly", (), members)())  # the engine refuses it too, by the same check


def test_an_empty_name_is_refused_at_registration(registry):
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        register_dialect(type("Nameless", (BaseDialect,), complete_members(""))())


def test_a_dialect_of_the_protocol_alone_gets_the_base_class_defaults():
    members = complete_members("protocol-only")
    members["nesting"] = True
    own = type("ProtocolOnly", (), members)()
    assert isinstance(own, Dialect) and not isinstance(own, BaseDialect)
    d = as_dialect(own)
    assert isinstance(d, BaseDialect) and repr(d) == repr(own)
    assert (d.name, d.open_tag, d.close_tag, d.nesting) == ("protocol-only", "<async>", "</async>", True)
    fork = Promise("t", 10, tags.promise_tag("t", 10))
    assert d.branches(fork) == [(fork, "<async>")]
    assert (d.fork_joins, d.join_tag, d.join_position(5, [9, 12]), d.inserted_bytes(Limits())) == (False, "", 5, 0)
    assert d.split_tree("x") is None and d.prompt(DEFAULT_PASTA_PROMPT) is NO_PROMPT
    assert d.clean_text(SAMPLES["pasta"]) == PASTA.clean_text(SAMPLES["pasta"])


# --------------------------------------------------------------------------- PASTA-LANG like the others


def test_pasta_is_a_dialect_like_the_others():
    assert type(PASTA).__module__ == "pasta_engine.lang.pasta" and isinstance(PASTA, BaseDialect)
    # its prompt comes from its class, not from its name or identity
    renamed = type("Renamed", (PastaDialect,), {"name": "pasta-renamed"})()
    assert dialect_prompt(renamed, DEFAULT_PASTA_PROMPT) is DEFAULT_PASTA_PROMPT
    assert dialect_prompt(apar.APAR, DEFAULT_PASTA_PROMPT) is apar.APAR_PROMPT
    assert dialect_prompt(multiverse.MULTIVERSE, DEFAULT_PASTA_PROMPT) is multiverse.MULTIVERSE_PROMPT
    # the engine's default and the name give the same object; the protocol's module re-exports it
    assert dialect_mod.PASTA is PASTA and dialect_mod.PastaDialect is PastaDialect


@pytest.mark.parametrize("name", DIALECT_NAMES)
def test_every_dialect_parser_emits_the_protocol_modules_events(name):
    d = get_dialect(name)
    items = d.parse(SAMPLES[name] + " [Fork <Path x> <promise")
    assert items
    for e in items:
        assert any(c.__module__ == "pasta_engine.lang.dialect" for c in type(e).__mro__), type(e)
    assert tags.Promise is Promise and tags.Sync is Sync and tags.AsyncOpen is AsyncOpen
    assert (tags.ASYNC_OPEN, tags.ASYNC_CLOSE, tags.SYNC) == (AsyncOpen().raw, AsyncClose().raw, Sync().raw)
