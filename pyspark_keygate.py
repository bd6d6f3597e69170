"""Lets PySpark find the ``keygate`` data source without ``spark.register(session)``.

PySpark (4.x) imports every top-level module named ``pyspark_*`` and registers its
``DefaultSource``; this shim is all that is needed for that. The source lives in spark/.
"""

from spark.source import KeygateDataSource as DefaultSource

__all__ = ["DefaultSource"]
