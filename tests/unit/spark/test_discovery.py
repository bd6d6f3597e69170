"""PySpark finds the keygate data source by itself, as its worker does: it imports every
top-level module named ``pyspark_*`` and registers the ``DefaultSource`` it defines."""

from __future__ import annotations

import importlib
import pkgutil

from pyspark.sql.datasource import DataSource


def test_pyspark_lookup_finds_the_keygate_source() -> None:
    found = {}
    for info in pkgutil.iter_modules():
        if info.name.startswith("pyspark_"):
            module = importlib.import_module(info.name)
            source = getattr(module, "DefaultSource", None)
            if isinstance(source, type) and issubclass(source, DataSource):
                found[source.name()] = source
    assert "keygate" in found
