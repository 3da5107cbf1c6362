"""The public face: ``elastic_batches.__all__``."""

from __future__ import annotations

import importlib
import inspect

import pytest

import elastic_batches

NAMES = list(elastic_batches.__all__)


def test_all_is_sorted_and_unique() -> None:
    assert NAMES == sorted(NAMES) and len(set(NAMES)) == len(NAMES)


@pytest.mark.parametrize("name", NAMES, ids=NAMES)
def test_every_public_name_imports_and_has_a_docstring_with_an_example(name: str) -> None:
    module = importlib.import_module("elastic_batches")
    obj = getattr(module, name)
    doc = inspect.getdoc(obj)
    assert doc and doc.strip(), f"{name} has no docstring"
    if not (inspect.isclass(obj) and issubclass(obj, BaseException)):
        assert ">>>" in doc, f"{name}'s docstring has no runnable example"


def test_star_import_gives_exactly_all() -> None:
    namespace: dict[str, object] = {}
    exec("from elastic_batches import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == sorted(NAMES)


def test_the_package_module_holds_only_imports() -> None:
    public = {k for k in vars(elastic_batches) if not k.startswith("_")}
    submodules = {k for k in public if inspect.ismodule(getattr(elastic_batches, k))}
    assert public - submodules == set(NAMES)
