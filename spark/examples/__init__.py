"""Runnable examples of keygate's Spark consumer (see docs/spark.md)."""

__all__: list[str] = []
