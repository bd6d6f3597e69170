"""Batch consumer example: per-customer totals of a queue's backlog, settled in SQL.

    .venv/bin/python -m spark.examples.batch_job [--url sqlite:///keygate-demo.db]
        [--queue demo-orders] [--group billing]

With an empty queue it first seeds 1,000 demo messages into it. Each run consumes the
group's unsettled backlog with ``consume_batch``: the job sums ``amount`` per key with
``groupBy(key)``, reports the messages whose amount it refuses (over 990) as failed, so
they are redelivered on the next run and end in ``<queue>.dlq`` after max_deliveries.
Run it twice: the second run only sees the failures.
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

import spark
from spark.examples.demo import arguments, local_session


def totals(df: DataFrame) -> list[str]:
    """Print per-customer totals; return the ids of messages refused."""
    amount = F.col("properties").getItem("amount").cast("int")
    per_key = df.groupBy("key").agg(F.count("*").alias("orders"), F.sum(amount).alias("total"))
    per_key.orderBy("key").show(50, truncate=False)
    return [row.message_id for row in df.where(amount > 990).select("message_id").collect()]


def main() -> None:
    args = arguments(__doc__, group="billing").parse_args()
    session = local_session("keygate-batch-example", args.url, args.queue)
    try:
        result = spark.consume_batch(session, args.url, args.queue, args.group, totals)
        print(result)
    finally:
        session.stop()


if __name__ == "__main__":
    main()
