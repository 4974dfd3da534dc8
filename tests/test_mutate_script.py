"""scripts/mutate.py's choice of mutants (the tool itself runs outside CI): a sample, the
functions a change touched, and how the summary names what was run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mutate_script", ROOT / "scripts" / "mutate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


M = _script()
NAMES = [
    "engine.journal.xǁJournalǁ_run_row__mutmut_3",
    "engine.journal.xǁJournalǁ_run_row__mutmut_12",
    "engine.journal.xǁJournalǁcreate_run__mutmut_1",
    "engine.journal.xǁ_Leaseǁ_run_row__mutmut_1",
    "engine.journal.x_chain_hash__mutmut_1",
    "engine.journal.x_chain_hash_of__mutmut_2",
]


def test_a_mutant_name_gives_its_function() -> None:
    assert M.function_of(NAMES[0]) == "Journal._run_row"
    assert M.function_of(NAMES[4]) == "chain_hash"
    assert M.function_of(NAMES[5]) == "chain_hash_of"


def test_functions_select_by_class_and_method_or_by_bare_name() -> None:
    assert M.of_functions(NAMES, ["Journal._run_row"]) == NAMES[:2]
    assert M.of_functions(NAMES, ["_run_row"]) == [NAMES[0], NAMES[1], NAMES[3]]
    # a function's name is matched whole: chain_hash is not chain_hash_of
    assert M.of_functions(NAMES, ["chain_hash", "create_run"]) == [NAMES[2], NAMES[4]]
    assert M.of_functions(NAMES, ["nothing"]) == []


def test_a_sample_is_seeded_and_never_larger_than_its_population() -> None:
    a = M.draw(NAMES, 3, seed=1)
    assert a == M.draw(NAMES, 3, seed=1) and len(set(a)) == 3 and set(a) <= set(NAMES)
    assert M.draw(NAMES, 99, seed=1) == NAMES


def test_the_summary_says_what_part_of_the_module_ran() -> None:
    def score(**kw: object) -> object:
        return M.Score("engine/journal.py", 10, 8, 1, [], 1.0, **kw)

    assert score().run == "whole"
    assert score(population=1900, seed=2).run == "sample of 1900, seed 2"
    assert (
        score(population=1900, functions=["create_run", "_hash_at"]).run
        == "functions create_run, _hash_at (1900 mutants in the module)"
    )
    assert (
        score(population=1900, seed=3, functions=["create_run"]).run
        == "functions create_run of 1900, seed 3"
    )
