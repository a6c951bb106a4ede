"""Every test file on disk is collected by the README's test command (`make test`: pytest on
its testpaths).

pytest's default `norecursedirs` skips any folder named `build`, `dist`, `venv`, `*.egg` or
starting with a dot: the 59 tests of the old `tests/build/` never ran under `make test` until
the package became `specrt/builder/` and its tests `tests/builder/`. These checks ask pytest's
own ignore hook (the one its collector calls) about every folder on the way to every test file
and about the file itself, so a folder or file that collection would skip fails here, whatever
the reason (norecursedirs, collect_ignore, a virtualenv marker, --ignore in addopts).
"""
from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def _test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def _defines_tests(path: Path) -> bool:
    """True if the module defines a test function or a Test class at its top level."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return any((isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test"))
               or (isinstance(n, ast.ClassDef) and n.name.startswith("Test")) for n in tree.body)


def _skipped_by(config, path: Path) -> Path | None:
    """The first folder (or the file itself) on the way from tests/ to `path` that pytest's
    collection would ignore, or None."""
    for p in [*reversed(path.relative_to(TESTS).parents), Path(path.relative_to(TESTS))]:
        full = TESTS / p
        if full == TESTS:
            continue
        if config.hook.pytest_ignore_collect(collection_path=full, config=config):
            return full
    return None


def test_no_test_file_sits_where_pytest_does_not_look(pytestconfig):
    files = [p for p in _test_files() if p.name.startswith("test_")]
    assert len(files) > 50, files                      # the walk found the suite
    skipped = {str(p.relative_to(TESTS)): str(_skipped_by(pytestconfig, p).relative_to(TESTS))
               for p in files if _skipped_by(pytestconfig, p) is not None}
    assert not skipped, (f"pytest never collects these test files (file: the folder it skips); rename the folder "
                         f"(norecursedirs = {pytestconfig.getini('norecursedirs')}): {skipped}")


def test_every_module_that_defines_tests_has_a_name_pytest_collects(pytestconfig):
    patterns = pytestconfig.getini("python_files")
    unnamed = [str(p.relative_to(TESTS)) for p in _test_files()
               if _defines_tests(p) and not any(fnmatch.fnmatch(p.name, pat) for pat in patterns)]
    assert not unnamed, f"these modules define tests but do not match python_files {patterns}: {unnamed}"


def test_the_testpaths_are_the_tests_folder(pytestconfig):
    """`make test` runs pytest with no path: it collects `testpaths`, which must be this folder."""
    assert [(Path(pytestconfig.rootpath) / p).resolve() for p in pytestconfig.getini("testpaths")] == [TESTS]


def test_the_whole_run_collected_every_test_file(request):
    """In a whole run (no paths, -k or -m given: what `make test` does, in each xdist worker
    too), every test file on disk contributed items to this session."""
    cfg = request.config
    whole = cfg.args_source == pytest.Config.ArgsSource.TESTPATHS and not cfg.option.keyword \
        and not cfg.option.markexpr
    collected = {Path(item.path).resolve() for item in request.session.items}
    assert Path(__file__).resolve() in collected
    if whole:
        missing = [str(p.relative_to(TESTS)) for p in _test_files()
                   if p.name.startswith("test_") and p not in collected]
        assert not missing, f"a whole run collected nothing from: {missing}"
