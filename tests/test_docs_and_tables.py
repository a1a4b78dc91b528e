"""Tables are consistent at registration, and the generated docs are not stale."""
import pytest

from qbackend import docs
from qbackend.lowering import TABLES, Lowering, Unsupported, check_tables
from qbackend.patterns import RULES


def test_every_rule_has_an_entry_on_every_device():
    for device, table in TABLES.items():
        assert set(table) == {rule.name for rule in RULES}, device
        assert all(isinstance(entry, (Lowering, Unsupported)) for entry in table.values())


def test_table_with_a_missing_rule_fails_at_registration():
    broken = {"cpu": {k: v for k, v in TABLES["cpu"].items() if k != "qconv"}}
    with pytest.raises(RuntimeError, match=r"missing rules \['qconv'\]"):
        check_tables(broken)


def test_table_naming_an_unknown_rule_fails_at_registration():
    broken = {"cpu": {**TABLES["cpu"], "qconv_gelu_typo": TABLES["cpu"]["qconv"]}}
    with pytest.raises(RuntimeError, match=r"unknown rules \['qconv_gelu_typo'\]"):
        check_tables(broken)


def test_every_rule_has_an_example_and_near_misses():
    for rule in RULES:
        assert rule.example is not None and rule.near_misses, rule.name


def test_generated_docs_are_current():
    assert docs.stale() == [], "run `python -m qbackend.docs` and commit docs/"
